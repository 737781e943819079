"""Causal attention across the CP ranks of one sequence by all-to-all (DeepSpeed-Ulysses).

**All-to-all** (``a2a``, DeepSpeed-Ulysses, :func:`ulysses_attention`): an all-to-all turns
``[b, H, s/CP, d]`` (sequence-sharded) into ``[b, H/CP, s, d]`` (head-sharded), the chunks are put
back in order, ordinary causal attention runs on whole sequences, and the inverse all-to-all
returns the layout; needs ``H`` and the query groups ``G`` divisible by ``CP``. A sliding window
(``window``: a query at ``i`` sees keys ``i - window .. i``) is exact: the whole sequence is in
order on every rank, so it is the one-process mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.parallel.exchange import all_to_all

from .chunks import chunk_ids


def _seq_to_heads(x, group, cp: int):
    """``[b, n, s_l, d]`` -> ``[b, n / CP, CP s_l, d]`` (sources' blocks in CP-rank order)."""
    b, n, s_l, d = x.shape
    parts = x.reshape(b, cp, n // cp, s_l, d).transpose(0, 1).reshape(cp * b * (n // cp), s_l, d)
    got = all_to_all(parts, group, [b * (n // cp)] * cp, [b * (n // cp)] * cp)
    return got.reshape(cp, b, n // cp, s_l, d).permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s_l, d)


def _heads_to_seq(x, group, cp: int):
    """Inverse of :func:`_seq_to_heads`."""
    b, n_l, s, d = x.shape
    s_l = s // cp
    parts = x.reshape(b, n_l, cp, s_l, d).permute(2, 0, 1, 3, 4).reshape(cp * b * n_l, s_l, d)
    got = all_to_all(parts, group, [b * n_l] * cp, [b * n_l] * cp)
    return got.reshape(cp, b, n_l, s_l, d).transpose(0, 1).reshape(b, cp * n_l, s_l, d)


def _natural_order(cp: int) -> list[int]:
    """Chunk order after the all-to-all (rank 0's two, rank 1's two, ...) -> position of each
    natural chunk in it."""
    arrived = [c for r in range(cp) for c in chunk_ids(cp, r)]
    return [arrived.index(c) for c in range(2 * cp)]


def ulysses_attention(q, k, v, group, cp: int, enable_gqa: bool, window: int | None = None):
    """Causal attention by two all-to-alls over the CP group (see the module doc); ``window``:
    how many earlier keys a query sees besides its own (None: all)."""
    order = _natural_order(cp)
    inverse = [order.index(i) for i in range(2 * cp)]
    q, k, v = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    q, k, v = (torch.cat([t.chunk(2 * cp, dim=2)[i] for i in order], dim=2) for t in (q, k, v))
    if window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    else:
        pos = torch.arange(q.shape[2], device=q.device)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(diff >= 0) & (diff <= window), enable_gqa=enable_gqa)
    out = torch.cat([out.chunk(2 * cp, dim=2)[i] for i in inverse], dim=2)
    return _heads_to_seq(out, group, cp)
