"""The pure region builder: which parameters go into which flat :class:`~.region.Region`.

Given the model chunks' trainable parameters (deduplicated, in registration order), the ZeRO
stage and the tied-parameter groups, :func:`build_regions` returns the regions in reduction order
and, for stage 3, the units to gather. It keeps no state and closes over no optimizer:

* stages 0-2: per chunk, the chunk's own (untied) parameters in reverse registration order (the
  order backward produces their gradients), cut into buckets of at most ``reduce_bucket_size``
  elements (:func:`buckets`); flushed after every micro-batch at stage 2, after the M-th at 0/1.
* stage 3: per chunk, one partitioned region per unit (:func:`~.stage3.find_units`, in reverse
  execution order), flushed every micro-batch; parameters registered in several modules or
  smaller than ``param_persistence_threshold`` elements stay whole in one *persistent* region
  per chunk, which behaves as stage 1 (flushed after M micro-batches).
* then one region per tie group (``shared_params``), flushed only in ``finish_grad_sync`` after
  its gradient was summed over the group.

Parameters on the meta device are materialized by the region that takes them
(``ctx.param_init``), so at stage 3 each unit's full parameters exist only while its region is
built: ``peak_unit_bytes`` records the most that were alive at once (one unit, when all is well).

A parameter's gradient enters the global norm on this rank unless it is in ``uncounted``
(TP-duplicated off TP rank 0, or a tied copy off its group's first rank).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .collectives import Collectives
from .host_memory import HEAP_REUSED_FP32_ELEMS
from .region import Region
from .stage3 import find_units

__all__ = ["RegionContext", "Regions", "build_regions", "build_expert_and_dense", "buckets", "cast_params",
           "largest_first", "split_shard_ranges", "trainable_params"]


@dataclass(frozen=True)
class RegionContext:
    """What every region of one optimizer shares (the keywords of :class:`Region`)."""

    comm: Collectives
    stage: int
    num_micro_batches: int
    dp_size: int
    dp_rank: int
    grad_dtype: torch.dtype
    uncounted: frozenset = frozenset()
    param_init: Callable | None = None   # values of meta-device parameters (materialized per region)
    device: torch.device | None = None   # where meta-device parameters are materialized
    group: str = "dp"                    # the Collectives group the regions reduce over ("edp": experts)

    def region(self, params, chunk: int, *, partitioned: bool = False, flush_every: int | None = None,
               keep_full: bool | None = None, shared: str | None = None) -> Region:
        """A region; by default flushed every micro-batch at stage 2, after M otherwise, keeping
        its full gradient at stages 0/1."""
        flush = flush_every if flush_every is not None else (1 if self.stage == 2 else self.num_micro_batches)
        keep = keep_full if keep_full is not None else self.stage <= 1
        return Region(params, [p not in self.uncounted for p in params], comm=self.comm, dp_size=self.dp_size,
                      dp_rank=self.dp_rank, stage=self.stage, partitioned=partitioned, flush_every=flush,
                      keep_full_grad=keep, grad_dtype=self.grad_dtype, shared=shared, chunk=chunk,
                      param_init=self.param_init, device=self.device, group=self.group)


@dataclass
class Regions:
    """:func:`build_regions`' result: ``regions`` in reduction order; ``units`` the stage-3
    ``(module, region, chunk index, is the chunk itself)``; ``persistent_numel`` the elements
    kept whole at stage 3."""

    regions: list[Region] = field(default_factory=list)
    units: list[tuple] = field(default_factory=list)
    persistent_numel: int = 0
    peak_unit_bytes: int = 0  # most bytes of partitioned regions' full parameters alive at once while building


def trainable_params(chunks) -> list[list[torch.nn.Parameter]]:
    """Per chunk, its parameters with ``requires_grad``, each parameter once over all chunks."""
    out, seen = [], set()
    for chunk in chunks:
        ps = [p for p in chunk.parameters() if p.requires_grad and p not in seen]
        seen.update(ps)
        out.append(ps)
    return out


def cast_params(trainable, params_dtype):
    """Cast every trainable parameter to ``params_dtype`` (default: the first one's dtype);
    returns (device of the first parameter, the dtype)."""
    first = next((p for ps in trainable for p in ps), None)
    if first is None:
        raise ValueError("no trainable parameters")
    dtype = params_dtype or first.dtype
    for ps in trainable:
        for p in ps:
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return first.device, dtype


def buckets(params, size: int) -> list[list]:
    """Split params (already in execution order) into runs of at most ``size`` elements: a run is
    closed before a parameter that would take it past ``size``, so only a parameter larger than
    ``size`` makes a run of its own that is longer (DeepSpeed's rule for its reduction bucket,
    ``reduce_independent_p_g_buckets_and_remove_grads`` in deepspeed/runtime/zero/stage_1_and_2.py
    @cde57d29). At stage 2 a bucket's full gradient is the transient the step holds beyond the
    formula's ``4 Phi / N``, so this bounds it by ``size`` (or the largest parameter)."""
    out, cur, n = [], [], 0
    for p in params:
        if cur and n + p.numel() > size:
            out.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += p.numel()
    if cur:
        out.append(cur)
    return out


HOST_ROUND_ELEMS = HEAP_REUSED_FP32_ELEMS  # stage 2 on the CPU: round gradients of at most 16 MiB (fp32)


def round_bucket_size(stage: int, size: int, device) -> int:
    """The bucket (elements) that cuts the regions. At stage 2 a region's full gradient is
    allocated for each round and freed when its reduction ends; on the CPU a block above glibc's
    largest dynamic mmap threshold (32 MiB) is a fresh mapping every time, whose pages fault in
    again each step (measured: 56 ms to allocate and touch 108 MB fresh, 11 ms reused), so there
    the bucket is capped at ``HOST_ROUND_ELEMS`` and the freed rounds come back from the heap. The
    flag keeps its meaning as DeepSpeed states it, the number of elements reduced at a time
    (``reduce_bucket_size``'s docstring, deepspeed/runtime/zero/config.py, DeepSpeed 0.19.8): a
    bound here; the other stages, and any accelerator, use it as given."""
    if stage == 2 and torch.device(device).type == "cpu":
        return min(size, HOST_ROUND_ELEMS)
    return size


def _stage3_chunk(ctx: RegionContext, out: Regions, c: int, chunk, own: list, threshold: int, chunk_units) -> None:
    """Stage 3 regions of chunk ``c``: one per unit, then the persistent parameters."""
    registrations = defaultdict(int)
    for m in chunk.modules():
        for p in m.parameters(recurse=False):
            registrations[p] += 1
    ownset = set(own)
    persistent = [p for p in own if registrations[p] > 1 or p.numel() < threshold]
    pset = set(persistent)
    for module, ups in reversed(find_units(chunk, chunk_units)):
        ups = [p for p in ups if p in ownset and p not in pset]
        if ups:
            r = ctx.region(ups, c, partitioned=True, flush_every=1, keep_full=False)
            out.peak_unit_bytes = max(out.peak_unit_bytes, _gathered_bytes(out.regions) + r.padded * r.param_flat.element_size())
            out.regions.append(r)
            out.units.append((module, r, c, module is chunk))
    if persistent:
        out.persistent_numel += sum(p.numel() for p in persistent)
        out.regions.append(ctx.region(list(reversed(persistent)), c, flush_every=ctx.num_micro_batches,
                                      keep_full=True))


def _gathered_bytes(regions) -> int:
    """Bytes of full parameters held by the partitioned regions (0 once each is released)."""
    return sum(r.param_flat.untyped_storage().nbytes() for r in regions if r.partitioned)


def build_regions(ctx: RegionContext, chunks, trainable, shared_of: dict, *, reduce_bucket_size: int,
                  param_persistence_threshold: int, units=None) -> Regions:
    """The regions of ``chunks`` (see the module docstring).

    ``trainable``: :func:`trainable_params` of the chunks; ``shared_of``: ``{param: tie-group
    name}`` of the tied parameters (insertion order = ``shared_params`` order), each name a group
    of ``ctx.comm``; ``units``: stage-3 unit modules per chunk (list of lists) or None (found).
    """
    out, specs = Regions(), []
    for c, (chunk, ps) in enumerate(zip(chunks, trainable)):
        own = [p for p in ps if p not in shared_of]
        if ctx.stage < 3:
            device = ctx.device if ctx.device is not None else (own[0].device if own else "cpu")
            size = round_bucket_size(ctx.stage, reduce_bucket_size, device)
            specs += [(b, c, {}) for b in buckets(list(reversed(own)), size)]
        else:
            _stage3_chunk(ctx, out, c, chunk, own, param_persistence_threshold,
                          units[c] if units is not None else None)
    for name in dict.fromkeys(shared_of.values()):
        ps = [p for p, n in shared_of.items() if n == name]
        specs.append((ps, -1, dict(flush_every=ctx.num_micro_batches, keep_full=True, shared=name)))
    out.regions += largest_first(ctx, specs)
    return out


def build_expert_and_dense(ctx: RegionContext, chunks, trainable, shared_of: dict, expert: set, topo, *,
                           reduce_bucket_size: int, param_persistence_threshold: int, units=None) -> Regions:
    """:func:`build_regions` for a model whose ``expert`` parameters (MoE routed experts, one EP
    rank's) reduce and shard over the expert-data-parallel group ``edp`` (``topo.edp`` ranks
    holding the same experts) and the rest over DP. Expert regions come first in reduction order
    (their layers' backward ends later, but gradient order only sets when a bucket fills); at
    stage 3 each expert module (:class:`~megazero.moe.experts.ExpertLinear`'s
    parent MLP) is a unit of its own, gathered inside its layer's unit."""
    if not expert:
        return build_regions(ctx, chunks, trainable, shared_of, reduce_bucket_size=reduce_bucket_size,
                             param_persistence_threshold=param_persistence_threshold, units=units)
    dense = [[p for p in ps if p not in expert] for ps in trainable]
    experts = [[p for p in ps if p in expert] for ps in trainable]
    ectx = replace(ctx, dp_size=topo.edp, dp_rank=topo.edp_rank, group="edp")
    expert_units = [[m for m in chunk.modules() if any(getattr(c, "expert_parallel", False) for c in m.children())]
                    for chunk in chunks]
    out = build_regions(ectx, chunks, experts, {}, reduce_bucket_size=reduce_bucket_size,
                        param_persistence_threshold=param_persistence_threshold, units=expert_units)
    rest = build_regions(ctx, chunks, dense, shared_of, reduce_bucket_size=reduce_bucket_size,
                         param_persistence_threshold=param_persistence_threshold, units=units)
    return Regions(out.regions + rest.regions, rest.units + out.units, out.persistent_numel + rest.persistent_numel,
                   max(out.peak_unit_bytes, rest.peak_unit_bytes))


def largest_first(ctx: RegionContext, specs) -> list[Region]:
    """The regions of ``specs`` (``(params, chunk, keywords)`` in reduction order, returned in
    that order), constructed largest first. Constructing a region copies (or, on the meta device,
    draws) its parameters, a transient of about its largest parameter's fp32 size; built first,
    the largest (the vocabulary matrix's) meets only its own state instead of every other
    region's (ZeRO-2, DP 4, 152M parameters: build peak 1.48 GB in reduction order)."""
    regions = [None] * len(specs)
    for k in sorted(range(len(specs)), key=lambda k: -sum(p.numel() for p in specs[k][0])):
        params, c, keywords = specs[k]
        regions[k] = ctx.region(params, c, **keywords)
    return regions


def split_shard_ranges(region, ids) -> tuple[list, list]:
    """(other, chosen) ``[a, b)`` ranges of ``region``'s shard: the pieces of the parameters whose
    ``id`` is in ``ids`` (merged where adjacent), and the rest, shard padding included (the
    optimizer's per-parameter learning rates, ``ZeroOptimizer.set_decoupled_params``)."""
    lo, hi = region.shard_lo, region.shard_lo + region.shard_len
    dec = []
    for p, o in zip(region.params, region.offsets):
        a, b = max(o, lo) - lo, min(o + p.numel(), hi) - lo
        if id(p) in ids and a < b:
            dec = dec[:-1] + [(dec[-1][0], b)] if dec and dec[-1][1] == a else dec + [(a, b)]
    cuts = [0] + [x for seg in dec for x in seg] + [region.shard_len]
    other = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2) if cuts[i] < cuts[i + 1]]
    return other, dec
