"""The one rule for how a parameter is split over the tensor-parallel (TP) ranks.

A module that splits a parameter says so in its ``partitions`` dict, ``{name: (dim,
partition_sizes, real_rows)}``; a parameter absent from it (or owned by a module without one) is
*replicated*: every TP rank holds the full tensor. Everything that needs the rule -- the model
(full <-> local conversion), ZeRO (which gradients to count once in the norm), checkpoints (the
index, resharding) and the converter -- reads it through this module, never the dict itself.

With ``p`` TP ranks, a split along ``dim`` of a full tensor whose ``dim`` has length ``n``:

* ``partition_sizes = None``: rank ``r`` holds rows ``[r n/p, (r+1) n/p)`` of ``dim``;
* ``partition_sizes = [n_1, ..., n_k]`` (``sum = n``; e.g. Q, K, V or gate, up): each logical
  block ``i`` is split ``p`` ways and rank ``r`` holds block ``r`` of every one, concatenated;
* ``real_rows = R`` (vocabulary matrices): only the first ``R`` rows are real; the full tensor is
  zero-padded to ``p * local_rows`` rows before the split, and cut back to ``R`` after a gather.

:func:`shard` and :func:`unshard` are exact inverses: ``unshard([shard(t, d, r, p) for r in
range(p)], d) == t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPSplit:
    """How one parameter is split: along ``dim``, in logical blocks ``partition_sizes`` (one
    block when None), with ``real_rows`` real rows of the full tensor (None: all rows real)."""

    dim: int
    partition_sizes: tuple[int, ...] | None = None
    real_rows: int | None = None

    def to_json(self) -> list:
        """``[dim, partition_sizes or None, real_rows]``: the checkpoint index's form."""
        sizes = [int(s) for s in self.partition_sizes] if self.partition_sizes else None
        return [int(self.dim), sizes, None if self.real_rows is None else int(self.real_rows)]

    @classmethod
    def from_json(cls, obj) -> "TPSplit | None":
        """Inverse of :meth:`to_json`; ``None`` (replicated) stays None."""
        if obj is None:
            return None
        dim, sizes, real_rows = obj
        return cls(int(dim), tuple(int(s) for s in sizes) if sizes else None,
                   None if real_rows is None else int(real_rows))

    def to_local(self, full: torch.Tensor, tp_rank: int, tp: int, local_rows: int | None = None) -> torch.Tensor:
        """This rank's slice of the full tensor. ``local_rows`` (the local length of ``dim``) is
        needed only with ``real_rows``, to know how far to zero-pad."""
        if self.real_rows is not None:
            padded_rows = (local_rows if local_rows is not None else -(-full.shape[self.dim] // tp)) * tp
            padded = full.new_zeros((padded_rows,) + tuple(full.shape[1:]))
            padded[:full.shape[0]] = full
            full = padded
        return shard(full, self.dim, tp_rank, tp, self.partition_sizes)

    def local_shape(self, full_shape, tp: int) -> tuple[int, ...]:
        """The shape :meth:`to_local` gives a full tensor of ``full_shape`` at creation (no
        tensor is made): ``dim`` padded to a multiple of ``tp`` with ``real_rows``, then ``/ tp``
        (each logical block ``n_i / tp``, which sums to the same)."""
        shape = [int(n) for n in full_shape]
        n = shape[self.dim]
        if self.real_rows is not None:
            n = -(-n // tp) * tp
        sizes = list(self.partition_sizes) if self.partition_sizes else [n]
        if sum(sizes) != n or any(s % tp for s in sizes):
            raise ValueError(f"cannot split sizes {sizes} of dim {self.dim} (shape {tuple(shape)}) {tp} ways")
        shape[self.dim] = n // tp
        return tuple(shape)

    def to_full(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full (unpadded) tensor from every TP rank's slice, in rank order."""
        full = unshard(pieces, self.dim, self.partition_sizes)
        return full[:self.real_rows] if self.real_rows is not None else full


def shard(full: torch.Tensor, dim: int, rank: int, p: int, partition_sizes=None) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``: block ``rank`` of each logical partition."""
    sizes = list(partition_sizes) if partition_sizes else [full.shape[dim]]
    if sum(sizes) != full.shape[dim] or any(s % p for s in sizes):
        raise ValueError(f"cannot split sizes {sizes} of dim {dim} (shape {tuple(full.shape)}) {p} ways")
    return torch.cat([b.chunk(p, dim)[rank] for b in full.split(sizes, dim)], dim).contiguous()


def unshard(pieces: list[torch.Tensor], dim: int, partition_sizes=None) -> torch.Tensor:
    """Inverse of :func:`shard` given every rank's slice (in rank order)."""
    p = len(pieces)
    sizes = list(partition_sizes) if partition_sizes else [pieces[0].shape[dim] * p]
    local = [s // p for s in sizes]
    blocks = [piece.split(local, dim) for piece in pieces]
    return torch.cat([torch.cat([blocks[r][i] for r in range(p)], dim) for i in range(len(sizes))], dim)


def tp_split(module: nn.Module, name: str) -> TPSplit | None:
    """The split of ``module``'s own parameter ``name``, or None when it is replicated."""
    parts = getattr(module, "partitions", None)
    spec = parts.get(name) if isinstance(parts, dict) else None
    if spec is None:
        return None
    dim, sizes, real_rows = spec
    return TPSplit(int(dim), tuple(int(s) for s in sizes) if sizes else None,
                   None if real_rows is None else int(real_rows))


def named_tp_params(root: nn.Module):
    """``(name, module, local name, param, split)`` of every parameter under ``root``, each once
    (the first name it is reachable by), in ``named_modules`` order."""
    seen = set()
    for mod_name, module in root.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), module, p_name, param, tp_split(module, p_name)


def tp_duplicated_params(roots, tp: int) -> list[nn.Parameter]:
    """Parameters replicated over TP (norms, row-parallel biases, position embeddings): their
    gradients are equal on every TP rank, so a global gradient norm counts them once. ``[]``
    with ``tp == 1``."""
    if tp == 1:
        return []
    return [param for root in roots for _, _, _, param, split in named_tp_params(root) if split is None]


def to_local(module: nn.Module, name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """``module.<name>``'s TP slice of the full tensor (the full tensor itself if replicated)."""
    split = tp_split(module, name)
    if split is None:
        return full
    local = getattr(module, name, None)  # None while the module is still creating it
    return split.to_local(full, tp_rank, tp, local_rows=None if local is None else local.shape[split.dim])


def to_full(module: nn.Module, name: str, local: torch.Tensor, tp_group) -> torch.Tensor:
    """The full, unpadded tensor of ``module.<name>`` from this rank's slice ``local``:
    an all-gather over ``tp_group`` (every TP rank calls it) for a split parameter, ``local``
    itself for a replicated one."""
    split = tp_split(module, name)
    if split is None:
        return local
    p = dist.get_world_size(tp_group) if tp_group is not None else 1
    if p == 1:
        return split.to_full([local])
    pieces = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(pieces, local.contiguous(), group=tp_group)
    return split.to_full(pieces)
