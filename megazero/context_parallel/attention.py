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
``dK += dS^T Q / sqrt(d)``. A rank sends ``CP - 1`` K/V blocks in forward; in backward the K/V
blocks go ahead again (``CP - 1`` hops, in flight while the current block is computed) and the
fp32 ``dK, dV`` of each block follow it, ``CP`` hops, the last one home. Scores are computed in
query-row tiles of at most ``TILE_ELEMS`` elements, so the quadratic buffer is bounded.

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

from megazero.parallel.exchange import all_to_all


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

    def __init__(self, group, ranks: list[int], tile_elems: int):
        self.group, self.ranks, self.tile_elems = group, ranks, tile_elems
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


TILE_ELEMS = 1 << 22  # score elements per tile (16 MiB in fp32): the ring's only quadratic buffer


def _tiles(q_block: torch.Tensor, L: int, tile_elems: int):
    """Row slices of a ``[b, H, L, d]`` query block so that one ``[b, H, rows, L]`` score tile
    holds at most ``tile_elems`` elements (flash attention's tiling, on the query side)."""
    b, H = q_block.shape[:2]
    rows = max(1, min(L, tile_elems // max(1, b * H * L)))
    return [slice(r, min(L, r + rows)) for r in range(0, L, rows)]


def _probs(q, k, rows: slice, causal: bool, scale: float, lse=None):
    """Scores of query ``rows`` against a key block, masked causally on the diagonal block
    (query row ``i`` sees keys ``<= i``); then ``exp(S - lse)`` in place, with ``lse`` the
    block's own log-sum-exp when not given. Returns ``(P, lse)``."""
    s = torch.matmul(q[:, :, rows], k.transpose(-1, -2)).mul_(scale)
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q.device).unsqueeze(1)
        s.masked_fill_(torch.arange(k.shape[2], device=q.device).unsqueeze(0) > i, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return s.sub_(lse).exp_(), lse


class RingAttention(torch.autograd.Function):
    """Causal attention of ``q [b, H, 2L, d]`` over the whole sequence whose K/V (``[b, G, 2L, d]``
    per rank) are spread over the CP ring (see the module doc). Scores are computed in row tiles
    (:func:`_tiles`, at most ``tile_elems`` elements) and turned into probabilities in place: a rank holds at most two score tiles
    at once, whatever the sequence length."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        rep, scale, L, acc = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2, _acc(q)
        o = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=acc, device=q.device)
        kv, qh = (k, v), [t.to(acc) for t in q.split(L, dim=2)]
        for step in range(ring.cp):
            src = (ring.rank - step) % ring.cp
            nxt, wait = ring.shift(list(kv)) if step < ring.cp - 1 else (None, None)
            kh, vh = ([b.to(acc) for b in _expand(t, rep).split(L, dim=2)] for t in kv)
            for qa, kb, causal in _pairs(ring.cp, ring.rank, src):
                for rows in _tiles(qh[qa], L, ring.tile_elems):
                    p, lse_b = _probs(qh[qa], kh[kb], rows, causal, scale)
                    at = slice(qa * L + rows.start, qa * L + rows.stop)
                    o[:, :, at], lse[:, :, at] = _merge(o[:, :, at], lse[:, :, at], torch.matmul(p, vh[kb]), lse_b)
                    del p
            if wait is not None:
                wait()
                kv = tuple(nxt)
        ctx.ring, ctx.rep = ring, rep
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring, rep, acc = ctx.ring, ctx.rep, _acc(q)
        scale, L = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        do = do.to(acc)
        D = (do * o).sum(dim=-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, grads = (k, v), [torch.zeros(k.shape, dtype=acc, device=k.device),
                             torch.zeros(v.shape, dtype=acc, device=v.device)]
        qf = q.to(acc)
        for step in range(ring.cp):  # K/V travel ahead (CP - 1 hops); dK, dV follow their block home (CP hops)
            src = (ring.rank - step) % ring.cp
            nxt, wait_kv = ring.shift(list(kv)) if step < ring.cp - 1 else (None, None)
            ke, ve = _expand(kv[0], rep).to(acc), _expand(kv[1], rep).to(acc)
            dke, dve = torch.zeros_like(ke), torch.zeros_like(ve)
            for qa, kb, causal in _pairs(ring.cp, ring.rank, src):
                rk = slice(kb * L, (kb + 1) * L)
                q_blk, do_blk = qf[:, :, qa * L:(qa + 1) * L], do[:, :, qa * L:(qa + 1) * L]
                for rows in _tiles(q_blk, L, ring.tile_elems):
                    at = slice(qa * L + rows.start, qa * L + rows.stop)
                    p, _ = _probs(q_blk, ke[:, :, rk], rows, causal, scale, lse[:, :, at])
                    dve[:, :, rk] += torch.matmul(p.transpose(-1, -2), do_blk[:, :, rows])
                    ds = torch.matmul(do_blk[:, :, rows], ve[:, :, rk].transpose(-1, -2)).sub_(D[:, :, at]).mul_(p)
                    del p
                    dq[:, :, at] += torch.matmul(ds, ke[:, :, rk]).mul_(scale)
                    dke[:, :, rk] += torch.matmul(ds.transpose(-1, -2), q_blk[:, :, rows]).mul_(scale)
                    del ds
            b, G = kv[0].shape[:2]
            grads[0] += dke.view(b, G, rep, *dke.shape[2:]).sum(2)
            grads[1] += dve.view(b, G, rep, *dve.shape[2:]).sum(2)
            grads, wait_grads = ring.shift(grads)
            wait_grads()
            if wait_kv is not None:
                wait_kv()
                kv = tuple(nxt)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q, k, v, group, ranks: list[int], tile_elems: int = TILE_ELEMS):
    """:class:`RingAttention` over the CP group (``ranks``: its members' global ranks);
    ``tile_elems``: the most score elements computed at once."""
    return RingAttention.apply(q, k, v, _Ring(group, ranks, tile_elems))


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
