"""Autograd collectives on the tensor-parallel (TP) group: the f/g pairs of Megatron-LM.

Notation: ``p`` is the TP group size, ``N`` the number of elements of the *full* (unsplit)
tensor. Volumes are each rank's logical ring-equivalent traffic in elements: an all-reduce of
``N`` moves ``2(p-1)/p * N``, an all-gather or a reduce-scatter whose full side is ``N`` moves
``(p-1)/p * N``. Every function is the identity (and issues nothing) when ``p == 1``.

=====================================  ==================================  =================================
function                               forward                             backward
=====================================  ==================================  =================================
:func:`copy_to_tp_region`      (f)     identity                            all-reduce (sum)
:func:`reduce_from_tp_region`  (g)     all-reduce (sum)                    identity
:func:`scatter_to_tp_region`           keep own chunk of last dim          all-gather last dim
:func:`gather_from_tp_region`          all-gather last dim                 keep own chunk of last dim
:func:`scatter_to_sequence_parallel_region`   keep own chunk of dim 0      all-gather dim 0
:func:`gather_from_sequence_parallel_region`  all-gather dim 0             reduce-scatter dim 0 (or split)
:func:`reduce_scatter_to_sequence_parallel_region`  reduce-scatter dim 0   all-gather dim 0
=====================================  ==================================  =================================

Sequence-parallel tensors use Megatron's ``[s, b, h]`` layout, so dim 0 is the sequence.

Which primitive runs is chosen per backend in one place, :mod:`megazero.parallel.primitives`, by measurement
(4 gloo ranks, one thread each, 4M-float full tensor): list ``all_gather`` 31 ms vs
``all_gather_single`` 59 ms; for reduce-scatter, ``all_reduce`` of the full tensor then a slice
24 ms vs list ``reduce_scatter`` 43 ms vs ``reduce_scatter_single`` 84 ms. So on gloo the
all-gather is the list form and the reduce-scatter runs as all-reduce + narrow (its wire volume is
an all-reduce's, ``2(p-1)/p N``, though the logical operation is a reduce-scatter); on NCCL and
every other backend the single-tensor ``all_gather_single`` / ``reduce_scatter_single`` run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.parallel.primitives import group_rank, group_size, primitives_for

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_gather_dim0", "reduce_scatter_dim0",
    "group_size", "group_rank",
]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _primitives(group) -> tuple[str, str]:
    """(all-gather primitive, reduce-scatter primitive) for this group's backend, from the
    project-wide table :data:`megazero.parallel.primitives.PRIMITIVES` (see module doc)."""
    table = primitives_for(dist.get_backend(group))
    return ("list" if table["all_gather"] == "all_gather_list" else "single",
            "all_reduce" if table["reduce_scatter"] == "all_reduce+slice" else "single")


# ---- raw (non-autograd) collectives along dim 0 -------------------------------------------
def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0. Volume ``(p-1)/p * N`` (N = output size)."""
    p = group_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    out = torch.empty((p * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _primitives(group)[0] == "list":
        dist.all_gather(list(out.chunk(p)), x, group=group)
    else:
        _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk of dim 0. Volume ``(p-1)/p * N`` (N = input)."""
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[0] % p:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by the TP size {p}")
    x = x.contiguous()
    if _primitives(group)[1] == "all_reduce":
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x.chunk(p)[group_rank(group)].contiguous()
    out = torch.empty((x.shape[0] // p,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[-1] % p:
        raise ValueError(f"last dim of size {x.shape[-1]} is not divisible by the TP size {p}")
    return x.chunk(p, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    p = group_size(group)
    if p == 1:
        return x
    moved = all_gather_dim0(x.movedim(-1, 0), group)  # [p * h/p, ...] in rank order
    return moved.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[0] % p:
        raise ValueError(f"sequence dim of size {x.shape[0]} is not divisible by the TP size {p}")
    return x.chunk(p)[group_rank(group)].contiguous()


# ---- autograd functions ---------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_is_partial:
            return reduce_scatter_dim0(g, ctx.group), None, None
        return _split_first(g, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


# ---- public API -------------------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """f: fwd identity; bwd all-reduce(sum) over ``group``. Volume (bwd) ``2(p-1)/p * N``.

    Enters a TP region with a replicated input (each rank's partial input-gradient sums to the
    full one). Applied to a replicated *parameter* used on sequence-split activations, it makes
    that parameter's gradient the sum over TP ranks (see the sequence-parallel norms).
    """
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """g: fwd all-reduce(sum) over ``group``; bwd identity. Volume (fwd) ``2(p-1)/p * N``."""
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd ``x[..., r*h/p:(r+1)*h/p]`` (no traffic); bwd all-gather of the last dim, ``(p-1)/p * N``."""
    if group_size(group) == 1:
        return x
    return _ScatterLast.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd all-gather of the last dim, ``(p-1)/p * N``; bwd keep own last-dim chunk (no traffic)."""
    if group_size(group) == 1:
        return x
    return _GatherLast.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd ``x[r*s/p:(r+1)*s/p]`` (no traffic); bwd all-gather of dim 0, ``(p-1)/p * N``.

    For a replicated ``[s, b, h]`` tensor entering a sequence-parallel region: its gradient is
    the concatenation of every rank's chunk gradient.
    """
    if group_size(group) == 1:
        return x
    return _ScatterSeq.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """fwd all-gather of dim 0, ``(p-1)/p * N``; bwd reduce-scatter of dim 0, ``(p-1)/p * N``.

    Leaves a sequence-parallel region into a TP region (the column-parallel linear's input):
    every rank's consumer contributes a partial gradient of the full sequence, so the backward
    sums them and keeps this rank's chunk. With ``grad_is_partial=False`` (the consumer is
    replicated, each rank's gradient already complete) the backward only keeps the chunk.
    """
    if group_size(group) == 1:
        return x
    return _GatherSeq.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd reduce-scatter(sum) of dim 0, ``(p-1)/p * N``; bwd all-gather of dim 0, ``(p-1)/p * N``.

    Replaces g (all-reduce) at the exit of a row-parallel linear when sequence parallelism is
    on: the partial sums are summed and each rank keeps its sequence chunk.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterSeq.apply(x, group)
