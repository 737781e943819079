"""Causal attention across the CP ranks of one sequence, by a ring of key/value blocks.

The sequence layout is :mod:`.chunks`' (rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``).

**Ring attention** (``p2p``, :class:`RingAttention`). Each rank keeps its queries; the key/value
blocks travel around the ring (``isend`` to ``r + 1``, ``irecv`` from ``r - 1``, the next block in
flight while the current one is computed). Against the K/V of rank ``src`` a rank computes one
block (:func:`_block`): at ``src = r`` its whole local block, causally (chunk ``r`` before chunk
``2CP-1-r``, so the top-left causal mask of the concatenation is the true one); for ``src < r``
all its queries against ``src``'s low chunk; for ``src > r`` its high chunk against both of
``src``'s (every other chunk pair is fully masked and skipped). A block yields
``o_b = softmax(S_b) V_b`` and ``lse_b = log sum_j exp(S_b)`` over its keys only
(``S_b = Q K_b^T / sqrt(d)``); rows carry a running ``(o, lse)`` (fp32) and merge by
log-sum-exp (online softmax, :func:`_merge`)::

    lse' = log(exp(lse) + exp(lse_b)),   o' = o exp(lse - lse') + o_b exp(lse_b - lse')

which equals one softmax over all keys. Backward re-walks the ring with ``dK, dV`` travelling
with their block (back at their owner after ``CP`` hops): with the rows' *final* ``(o, lse)``,
``P = exp(S - lse)`` are the exact probabilities and ``D = rowsum(dO o O)``: ``dV += P^T dO``,
``dS = P o (dO V^T - D)``, ``dQ += dS K / sqrt(d)``, ``dK += dS^T Q / sqrt(d)``. A rank sends
``CP - 1`` K/V blocks in forward; in backward the K/V blocks go ahead again (``CP - 1`` hops, in
flight while the current block is computed) and the fp32 ``dK, dV`` of each block follow it,
``CP`` hops, the last one home.

**Block kernels** (:func:`_kernel`; K/V repeated to the query heads for GQA, gradients summed
back per group). A fused kernel that returns its log-sum-exp runs each block; its backward, given
the final ``(o, lse)``, yields exactly the block's terms above. CPU:
``aten._scaled_dot_product_flash_attention_for_cpu`` / ``..._backward`` in fp32 (fp64 kept), CP 1's
SDPA kernel, no ``L x L`` buffer. CUDA, fp16 / bf16 / fp32, ``d % 8 == 0``:
``aten._scaled_dot_product_efficient_attention`` / ``..._backward`` in the input dtype. Elsewhere
(or ``fused=False``): explicit matmul / ``exp`` in fp32 query-row tiles of at most ``TILE_ELEMS``
score elements (:class:`_Explicit`).

**Sliding window** (``window``: query position ``i`` sees keys ``i - window .. i``, exact). A block's
query and key rows have known true positions (:func:`.chunks.positions_for_rank` of this rank and
of ``src``), so every block runs the explicit kernel with the mask ``0 <= i - j <= window`` on
those positions (the fused kernels take only a causal flag). A row with no key of the block in
its window gets ``o_b = 0``, ``lse_b = -inf``, which the merge leaves out (``exp(-inf) = 0``); every
row sees at least itself in the rank's own block (step 0), so the final ``lse`` is finite and the
backward's ``P = exp(S - lse)`` is 0 exactly where the mask is. A block whose keys are all more
than ``window`` before its first query is skipped in both directions (its K/V still travel on).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .chunks import chunk_ids, positions_for_rank

def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or the input's when wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _merge(o, lse, o_b, lse_b) -> None:
    """Fold a block's ``(o_b, lse_b)`` into the running rows ``(o, lse)`` (views), in place:
    ``lse' = log(exp(lse) + exp(lse_b))``, ``o' = o exp(lse - lse') + o_b exp(lse_b - lse')``."""
    new = torch.logaddexp(lse, lse_b)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def _block(cp: int, rank: int, src: int, L: int) -> tuple[slice, slice, bool]:
    """``(query rows, key rows, causal)`` of the one block rank ``rank`` computes against ``src``'s
    K/V (module doc); the chunk pairs left out are fully masked."""
    whole = slice(0, 2 * L)
    if src == rank:
        return whole, whole, True
    return (whole, slice(0, L), False) if src < rank else (slice(L, 2 * L), whole, False)


class _Ring:
    """One rank's ring over the CP group (global ranks of its members); ``tile_elems`` and
    ``fused`` choose the block kernel (:func:`_kernel`)."""

    def __init__(self, group, ranks: list[int], tile_elems: int, fused: bool = True, window: int | None = None):
        self.group, self.ranks, self.tile_elems, self.fused = group, ranks, tile_elems, fused
        self.cp, self.rank, self.window = len(ranks), dist.get_rank(group), window

    def shift(self, tensors: list[torch.Tensor]):
        """Start sending ``tensors`` to ``r + 1`` and receiving the same shapes from ``r - 1``;
        returns ``(received, wait)``."""
        nxt, prv = self.ranks[(self.rank + 1) % self.cp], self.ranks[(self.rank - 1) % self.cp]
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prv, self.group) for t in recv]
        works = dist.batch_isend_irecv(ops)
        return recv, lambda: [w.wait() for w in works]


def _mask(ring, src: int, rq: slice, rk: slice, causal: bool, L: int, device):
    """A block's mask argument for the kernel: ``causal`` without a window; with one, the
    ``(query positions, key positions, window)`` of the block's rows (module doc), or None when
    the block is wholly outside the window (skipped: exactly what its ``lse = -inf`` would add)."""
    window = getattr(ring, "window", None)
    if window is None:
        return causal
    if _span(ring.cp, ring.rank, rq, L)[0] - _span(ring.cp, src, rk, L)[1] > window:
        return None  # every key of the block is out of every row's window: nothing to compute
    q_pos = positions_for_rank(2 * L, ring.cp, ring.rank, device)[rq]
    return q_pos, positions_for_rank(2 * L, ring.cp, src, device)[rk], window


def _span(cp: int, rank: int, rows: slice, L: int) -> tuple[int, int]:
    """(first, last) true position of a chunk-aligned ``rows`` slice of rank ``rank``'s tokens."""
    chunks = chunk_ids(cp, rank)[rows.start // L:rows.stop // L]
    return min(chunks) * L, max(chunks) * L + L - 1


def _expand(t, rep):
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _fold(t, rep, dtype):
    """The gradient of :func:`_expand`: sums the ``rep`` heads of each group, in ``dtype``."""
    return t.unflatten(1, (t.shape[1] // rep, rep)).sum(2, dtype=dtype) if rep > 1 else t.to(dtype)


TILE_ELEMS = 1 << 22  # score elements per tile (16 MiB in fp32): the explicit kernel's quadratic buffer


class _FlashCPU:
    """PyTorch's CPU flash kernel: ``(o, lse)`` of a block, and its backward from the final rows."""
    upcast = True  # runs in the accumulation dtype

    @staticmethod
    def forward(q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(do, q, k, v, o, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, scale=scale)


class _EfficientCUDA:
    """The CUDA memory-efficient kernel (fp16, bf16, fp32; head size a multiple of 8), in the
    input dtype, on contiguous inputs (called directly, it gets no SDPA alignment checks)."""
    upcast = False

    @staticmethod
    def forward(q, k, v, causal, scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return o, lse[..., :q.shape[2]]  # its rows are padded to a multiple of 32

    @staticmethod
    def backward(do, q, k, v, o, lse, causal, scale):
        do, q, k, v, o = (t.contiguous() for t in (do, q, k, v, o))
        none = torch.empty(0, dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, o, lse, none, none, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv


class _Explicit:
    """The fallback: scores by matmul in query-row tiles of at most ``tile_elems`` elements
    (flash attention's tiling on the query side), turned into probabilities in place."""
    upcast = True

    def __init__(self, tile_elems: int):
        self.tile_elems = tile_elems

    def _tiles(self, q, n_keys: int):
        b, H, M = q.shape[:3]
        rows = max(1, min(M, self.tile_elems // max(1, b * H * n_keys)))
        return [slice(r, min(M, r + rows)) for r in range(0, M, rows)]

    @staticmethod
    def _probs(q, k, rows: slice, causal, scale: float, lse=None):
        """``exp(S - lse)`` of query ``rows`` (query ``i`` sees keys ``<= i`` when ``causal`` is
        True; a ``(query positions, key positions, window)`` tuple: keys with ``0 <= i - j <=
        window``), ``lse`` the rows' own log-sum-exp unless given (-inf for a row with no key:
        its ``P`` is 0); returns ``(P, lse)``."""
        s = torch.matmul(q[:, :, rows], k.transpose(-1, -2)).mul_(scale)
        if causal is True:
            i = torch.arange(rows.start, rows.stop, device=q.device).unsqueeze(1)
            s.masked_fill_(torch.arange(k.shape[2], device=q.device).unsqueeze(0) > i, float("-inf"))
        elif causal is not False:
            q_pos, k_pos, window = causal
            diff = q_pos[rows].unsqueeze(1) - k_pos.unsqueeze(0)
            s.masked_fill_((diff < 0) | (diff > window), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        return s.sub_(lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)).exp_(), lse

    def forward(self, q, k, v, causal, scale):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
        for rows in self._tiles(q, k.shape[2]):
            p, lse[:, :, rows] = self._probs(q, k, rows, causal, scale)
            o[:, :, rows] = torch.matmul(p, v)
        return o, lse

    def backward(self, do, q, k, v, o, lse, causal, scale):
        D = (do * o).sum(dim=-1, keepdim=True)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in self._tiles(q, k.shape[2]):
            p, _ = self._probs(q, k, rows, causal, scale, lse[:, :, rows])
            dv += torch.matmul(p.transpose(-1, -2), do[:, :, rows])
            ds = torch.matmul(do[:, :, rows], v.transpose(-1, -2)).sub_(D[:, :, rows]).mul_(p)
            del p
            dq[:, :, rows] = torch.matmul(ds, k).mul_(scale)
            dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows]).mul_(scale)
        return dq, dk, dv


def _kernel(q: torch.Tensor, ring):
    """The block kernel for ``q`` (module doc): fused where the backend returns its log-sum-exp
    (and no window asks for a mask)."""
    if getattr(ring, "fused", True) and getattr(ring, "window", None) is None:
        if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            return _FlashCPU
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32) \
                and q.shape[-1] % 8 == 0:
            return _EfficientCUDA
    return _Explicit(ring.tile_elems)


class RingAttention(torch.autograd.Function):
    """Causal attention of ``q [b, H, 2L, d]`` over the whole sequence whose K/V (``[b, G, 2L, d]``
    per rank) are spread over the CP ring (see the module doc): one block kernel call per ring
    step, merged by log-sum-exp into fp32 ``(o, lse)``."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        kernel, acc = _kernel(q, ring), _acc(q)
        work = acc if kernel.upcast else q.dtype
        rep, scale, L = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        qw, kv, o, lse = q.to(work), (k, v), None, None
        for step in range(ring.cp):
            src = (ring.rank - step) % ring.cp
            nxt, wait = ring.shift(list(kv)) if step < ring.cp - 1 else (None, None)
            rq, rk, causal = _block(ring.cp, ring.rank, src, L)
            mask = _mask(ring, src, rq, rk, causal, L, q.device)
            if mask is not None:
                ke, ve = (_expand(t[:, :, rk].to(work), rep) for t in kv)
                o_b, lse_b = kernel.forward(qw[:, :, rq], ke, ve, mask, scale)
                if o is None:  # step 0: the rank's own block covers every query row
                    o, lse = o_b.to(acc), lse_b.to(acc).contiguous()
                else:
                    _merge(o[:, :, rq], lse[:, :, rq], o_b, lse_b)
                del o_b, lse_b, ke, ve
            if wait is not None:
                wait()
                kv = tuple(nxt)
        ctx.ring, ctx.rep, ctx.kernel = ring, rep, kernel
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring, rep, kernel, acc = ctx.ring, ctx.rep, ctx.kernel, _acc(q)
        work = acc if kernel.upcast else q.dtype
        scale, L = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        qw, dow, ow = q.to(work), do.to(work), o.to(work)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, grads = (k, v), [torch.zeros(k.shape, dtype=acc, device=k.device),
                             torch.zeros(v.shape, dtype=acc, device=v.device)]
        for step in range(ring.cp):  # K/V travel ahead (CP - 1 hops); dK, dV follow their block home (CP hops)
            src = (ring.rank - step) % ring.cp
            nxt, wait_kv = ring.shift(list(kv)) if step < ring.cp - 1 else (None, None)
            rq, rk, causal = _block(ring.cp, ring.rank, src, L)
            mask = _mask(ring, src, rq, rk, causal, L, q.device)
            if mask is not None:
                ke, ve = (_expand(t[:, :, rk].to(work), rep) for t in kv)
                dq_b, dk_b, dv_b = kernel.backward(dow[:, :, rq], qw[:, :, rq], ke, ve, ow[:, :, rq],
                                                   lse[:, :, rq].contiguous(), mask, scale)
                dq[:, :, rq] += dq_b
                grads[0][:, :, rk] += _fold(dk_b, rep, acc)
                grads[1][:, :, rk] += _fold(dv_b, rep, acc)
                del dq_b, dk_b, dv_b, ke, ve
            grads, wait_grads = ring.shift(grads)
            wait_grads()
            if wait_kv is not None:
                wait_kv()
                kv = tuple(nxt)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q, k, v, group, ranks: list[int], tile_elems: int = TILE_ELEMS, fused: bool = True,
                   window: int | None = None):
    """:class:`RingAttention` over the CP group (``ranks``: its members' global ranks);
    ``fused=False`` forces the explicit kernel, whose score tiles hold at most ``tile_elems``;
    ``window``: a query sees the keys up to ``window`` positions back (module doc)."""
    return RingAttention.apply(q, k, v, _Ring(group, ranks, tile_elems, fused, window))
