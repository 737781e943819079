"""Context parallelism: one sequence split over ``CP`` ranks, and causal attention across them.

**Load-balanced layout.** The ``s`` positions are cut into ``2 CP`` chunks of ``L = s / (2 CP)``;
CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r`` (:func:`chunk_ids`), concatenated. Under a
causal mask chunk ``c`` attends to ``c + 1`` chunks, so every rank does ``2 CP + 1`` chunk-pairs
of work (Megatron-core's layout, ``get_batch_on_this_cp_rank``). Tokens, labels, loss mask and
positions are sliced the same way (:func:`slice_for_rank`); RoPE and learned positions use each
token's true position.

**Ring attention** (``p2p``, :class:`RingAttention`). Each rank keeps its queries; the key/value
blocks travel around the ring (``isend`` to ``r + 1``, ``irecv`` from ``r - 1``, the next block in
flight while the current one is computed). For query chunk ``a`` and key chunk ``b`` of the block
at hand: ``b > a`` is fully masked (skipped), ``b < a`` fully visible, ``b = a`` causal. Partial
results merge by log-sum-exp (online softmax, fp32): for rows with running ``(o, lse)`` and a
block's ``(o_b, lse_b)`` (``o_b = softmax(S_b) V_b`` over that block only)::

    lse' = log(exp(lse) + exp(lse_b)),   o' = o exp(lse - lse') + o_b exp(lse_b - lse')

which equals one softmax over all keys. Backward re-walks the ring with ``dK, dV`` travelling
with their block (back at their owner after ``CP`` hops): with ``P = exp(S - lse)``,
``D = rowsum(dO o O)``: ``dV += P^T dO``, ``dS = P o (dO V^T - D)``, ``dQ += dS K / sqrt(d)``,
``dK += dS^T Q / sqrt(d)``. Per direction a rank sends ``CP - 1`` K/V blocks forward and ``CP``
(K, V, dK, dV) blocks backward.

**All-to-all** (``a2a``, DeepSpeed-Ulysses, :func:`ulysses_attention`): an all-to-all turns
``[b, H, s/CP, d]`` (sequence-sharded) into ``[b, H/CP, s, d]`` (head-sharded), the chunks are put
back in order, ordinary causal attention runs on whole sequences, and the inverse all-to-all
returns the layout; needs ``H`` and the query groups ``G`` divisible by ``CP``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.tensor_parallel.expert_comm import all_to_all


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 CP``) CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def slice_for_rank(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This CP rank's chunks of ``t`` along its sequence dimension ``dim``, concatenated."""
    if cp == 1:
        return t
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {t.shape[dim]} is not divisible by 2 x CP = {2 * cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp, rank)], dim=dim)


def positions_for_rank(s_local: int, cp: int, rank: int, device) -> torch.Tensor:
    """The true positions (``[s_local]``) of this rank's tokens."""
    L = s_local // 2
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in chunk_ids(cp, rank)])


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or the input's when wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _block(q, k, v, mask, scale):
    """``(o_b, lse_b)`` of queries over one key block: fp32 scores, ``mask`` True = hidden."""
    acc = _acc(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    return torch.matmul(p, v.to(acc)), lse


def _merge(o, lse, o_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    return o * torch.exp(lse - new) + o_b * torch.exp(lse_b - new), new


def _pairs(cp: int, rank: int, src: int):
    """``(query half, key half, causal)`` sub-blocks with any visible key (the rest skipped)."""
    out = []
    for qa, a in enumerate(chunk_ids(cp, rank)):
        for kb, b in enumerate(chunk_ids(cp, src)):
            if b <= a:
                out.append((qa, kb, b == a))
    return out


class _Ring:
    """One rank's ring over the CP group (global ranks of its members)."""

    def __init__(self, group, ranks: list[int]):
        self.group, self.ranks = group, ranks
        self.cp, self.rank = len(ranks), dist.get_rank(group)

    def shift(self, tensors: list[torch.Tensor]):
        """Start sending ``tensors`` to ``r + 1`` and receiving the same shapes from ``r - 1``;
        returns ``(received, wait)``."""
        nxt, prv = self.ranks[(self.rank + 1) % self.cp], self.ranks[(self.rank - 1) % self.cp]
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prv, self.group) for t in recv]
        works = dist.batch_isend_irecv(ops)
        return recv, lambda: [w.wait() for w in works]


def _expand(t, rep):
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _causal(L, device):
    return torch.ones(L, L, dtype=torch.bool, device=device).triu(1)


class RingAttention(torch.autograd.Function):
    """Causal attention of ``q [b, H, 2L, d]`` over the whole sequence whose K/V (``[b, G, 2L, d]``
    per rank) are spread over the CP ring (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        rep, scale, L = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        mask = _causal(L, q.device)
        o = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=_acc(q), device=q.device)
        kv, qh = (k, v), q.split(L, dim=2)
        for step in range(ring.cp):
            src = (ring.rank - step) % ring.cp
            nxt, wait = ring.shift(list(kv)) if step < ring.cp - 1 else (None, None)
            kh, vh = (_expand(t, rep).split(L, dim=2) for t in kv)
            for qa, kb, causal in _pairs(ring.cp, ring.rank, src):
                rows = slice(qa * L, (qa + 1) * L)
                o_b, lse_b = _block(qh[qa], kh[kb], vh[kb], mask if causal else None, scale)
                o[:, :, rows], lse[:, :, rows] = _merge(o[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if wait is not None:
                wait()
                kv = tuple(nxt)
        ctx.ring, ctx.rep = ring, rep
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring, rep = ctx.ring, ctx.rep
        scale, L = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        mask = _causal(L, q.device)
        acc = _acc(q)
        do = do.to(acc)
        D = (do * o).sum(dim=-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        state = [k, v, torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        qf = q.to(acc)
        for step in range(ring.cp):
            src = (ring.rank - step) % ring.cp
            kk, vv, dk, dv = state
            ke, ve = _expand(kk, rep).to(acc), _expand(vv, rep).to(acc)
            dke, dve = torch.zeros_like(ke), torch.zeros_like(ve)
            for qa, kb, causal in _pairs(ring.cp, ring.rank, src):
                rq, rk = slice(qa * L, (qa + 1) * L), slice(kb * L, (kb + 1) * L)
                s = torch.matmul(qf[:, :, rq], ke[:, :, rk].transpose(-1, -2)) * scale
                if causal:
                    s = s.masked_fill(mask, float("-inf"))
                p = torch.exp(s - lse[:, :, rq])
                dve[:, :, rk] += torch.matmul(p.transpose(-1, -2), do[:, :, rq])
                ds = p * (torch.matmul(do[:, :, rq], ve[:, :, rk].transpose(-1, -2)) - D[:, :, rq])
                dq[:, :, rq] += torch.matmul(ds, ke[:, :, rk]) * scale
                dke[:, :, rk] += torch.matmul(ds.transpose(-1, -2), qf[:, :, rq]) * scale
            b, G = kk.shape[:2]
            dk = dk + dke.view(b, G, rep, *dke.shape[2:]).sum(2)
            dv = dv + dve.view(b, G, rep, *dve.shape[2:]).sum(2)
            received, wait = ring.shift([kk, vv, dk, dv])  # after the last step: dK, dV home
            wait()
            state = received
        return dq.to(q.dtype), state[2].to(k.dtype), state[3].to(v.dtype), None


def ring_attention(q, k, v, group, ranks: list[int]):
    """:class:`RingAttention` over the CP group (``ranks``: its members' global ranks)."""
    return RingAttention.apply(q, k, v, _Ring(group, ranks))


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


def ulysses_attention(q, k, v, group, cp: int, enable_gqa: bool):
    """Causal attention by two all-to-alls over the CP group (see the module doc)."""
    order = _natural_order(cp)
    inverse = [order.index(i) for i in range(2 * cp)]
    q, k, v = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    q, k, v = (torch.cat([t.chunk(2 * cp, dim=2)[i] for i in order], dim=2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    out = torch.cat([out.chunk(2 * cp, dim=2)[i] for i in inverse], dim=2)
    return _heads_to_seq(out, group, cp)
