"""Variable-size collectives (MoE token dispatch, all-to-all attention), each with its autograd inverse.

Token counts differ per rank and per expert, so the dispatchers move rows with per-peer split
sizes (lists of row counts, in group-rank order, known on every rank of the exchange):

* :func:`all_to_all` -- row block ``j`` of ``x`` (``in_splits[j]`` rows) goes to peer ``j``;
  peer ``j``'s block for us arrives as block ``j`` of the output (``out_splits[j]`` rows).
  Backward: the same exchange with the splits swapped. Volume: the rows sent to other ranks.
* :func:`all_gather_v` -- every rank's ``x`` (``sizes[j]`` rows on rank ``j``) concatenated in
  rank order. Backward: :func:`reduce_scatter_v` of the gradient (each rank's consumers
  contributed partial gradients for every row: the sum over ranks, each keeping its own rows).
* :func:`reduce_scatter_v` -- sum ``x`` (``sum(sizes)`` rows, equal shape everywhere) over the
  group, each rank keeping its ``sizes[rank]`` rows. Backward: :func:`all_gather_v`.

gloo has no variable-size all-gather or reduce-scatter: all-gather pads every block to the
largest, reduce-scatter is an all-reduce and a slice (the ``all_reduce+slice`` fallback the TP
mappings use, :mod:`megazero.parallel.primitives`).

Used by the MoE dispatchers (:mod:`megazero.moe.dispatch`) and by context parallelism's
all-to-all attention (:mod:`megazero.context_parallel.ulysses`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .primitives import group_rank, group_size


def _all_to_all_raw(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _all_gather_v_raw(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    p, most = len(sizes), max(sizes)
    padded = x.new_zeros((most,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((p * most,) + tuple(x.shape[1:]))
    dist.all_gather(list(out.chunk(p)), padded, group=group)
    return torch.cat([block[:n] for block, n in zip(out.chunk(p), sizes)])


def _reduce_scatter_v_raw(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[:group_rank(group)])
    return total[start:start + sizes[group_rank(group)]]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        return _all_to_all_raw(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all_raw(g, ctx.group, in_splits, out_splits), None, None, None


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _all_gather_v_raw(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_v_raw(g, ctx.group, ctx.sizes), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_v_raw(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_v_raw(g.contiguous(), ctx.group, ctx.sizes), None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Exchange row blocks with every peer (see module doc); identity on one rank."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def all_gather_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (``sizes[j]`` on rank ``j``); identity on one rank."""
    if group_size(group) == 1:
        return x
    return _AllGatherV.apply(x, group, list(sizes))


def reduce_scatter_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Sum over the group, keep this rank's ``sizes[rank]`` rows; identity on one rank."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, group, list(sizes))


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` ``[p, k]`` (row ``j``: what this rank sends peer ``j``) -> ``[p, k]`` (row ``j``:
    what peer ``j`` sends this rank); no autograd."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
