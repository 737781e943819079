"""The three collectives ZeRO needs, one primitive per backend, and honest accounting.

Volumes are counted two ways, per rank, in elements of the *full* (unsharded) tensor ``L``:

* **logical** (ring-equivalent algorithm volume, the ZeRO paper's unit): ``all_reduce`` moves
  ``2L`` (reduce-scatter + all-gather), ``reduce_scatter`` moves ``L``, ``all_gather`` moves ``L``.
  The ``(N-1)/N`` ring factor is left out, as in the paper, so stage 0-2 come to exactly 2Φ and
  stage 3 to 3Φ.  ``L`` counts real parameter elements only (padding excluded); the padded length
  handed to the primitive is counted separately as ``handed_elems``/``handed_bytes``.
* **primitive**: the ring-equivalent volume of what actually ran.  On gloo the fastest
  "reduce-scatter" is an ``all_reduce`` whose slice is kept (measured below), which moves ``2L``:
  the report says so (``primitive="all_reduce+slice"``, ``primitive_elems = 2L``).

Primitive choice (``megazero.parallel.primitives.PRIMITIVES``, shared with tensor parallelism), by
measurement, 4 ranks x 4M fp32, one thread each:

=========  ==========================  =========================================
backend    reduce_scatter               all_gather
=========  ==========================  =========================================
nccl       ``reduce_scatter_tensor``    ``all_gather_into_tensor``  (true ring ops)
gloo       ``all_reduce`` + slice 32 ms  list ``all_gather`` 19 ms
           (list 80 ms, tensor 158 ms)   (``all_gather_into_tensor`` 57 ms)
=========  ==========================  =========================================

Memory: gloo's list ``all_gather`` first gathers into a flat temporary as large as the whole
output and then copies it into the list (measured, 4 ranks: +304 MB for a 304 MB bf16 output;
``all_gather_into_tensor`` +0, ``all_reduce`` in place +4 MB for 608 MB), so the list form runs
in pieces of ``LIST_GATHER_ELEMS`` output elements (each rank's shard cut at the same offsets;
the same logical volume, counted as one call): a stage-1/2 write-back of the whole model then
needs at most 16 MiB of temporary, reused from the heap, instead of a second copy of the weights.

Groups of size 1 are skipped (a copy at most) and count nothing.  Every call may be async; the
returned :class:`Pending` finishes the work (slice copy) in ``wait()``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.parallel.primitives import PRIMITIVES, primitives_for  # the per-backend choice (one place)

from .host_memory import HEAP_REUSED_FP32_ELEMS

# ring-equivalent volume of each primitive as a multiple of the full tensor's length
PRIMITIVE_FACTOR = {"all_reduce": 2, "reduce_scatter_tensor": 1, "reduce_scatter_list": 1,
                    "all_reduce+slice": 2, "all_gather_into_tensor": 1, "all_gather_list": 1}
LOGICAL_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
# the list all-gather (gloo) gathers into a flat temporary of the whole output first, then copies
# it into the list: it runs in pieces of at most this many output elements (16 MiB of fp32), so
# the temporary stays below glibc's largest dynamic mmap threshold (32 MiB) and is reused from
# the heap; a 64 MB piece was a fresh mapping faulted in at every write-back
LIST_GATHER_ELEMS = HEAP_REUSED_FP32_ELEMS
# stage 3's unit gathers keep pieces of 2^24 elements: their temporary, like the unit itself, is
# then at least the unit threshold (``host_memory.unit_threshold``) and returned on free; pieces
# below it would stay in the heap (measured at DP 4: step peak 1.35 -> 1.51 GB with 2^22)
UNIT_GATHER_ELEMS = 1 << 24


class Pending:
    """An in-flight collective; ``wait()`` blocks and runs the finishing step (e.g. keep a slice)."""

    __slots__ = ("_work", "_then")

    def __init__(self, work=None, then=None):
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


class _All:
    """Several async works as one (``wait`` waits for each)."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Collectives:
    """Bucketed collectives over named groups with per-step accounting.

    ``groups``: name -> (process group or None, size, rank in group).  ``backend``: 'nccl' or
    'gloo'; ``overrides`` can replace entries of :data:`PRIMITIVES` (e.g. ``{"reduce_scatter":
    "reduce_scatter_list"}``) for experiments.
    """

    def __init__(self, groups: dict, backend: str, overrides: dict | None = None):
        self.groups = groups
        self.backend = backend
        self.primitives = primitives_for(backend)
        self.primitives.update(overrides or {})
        self.list_gather_elems = LIST_GATHER_ELEMS
        self.stats = defaultdict(lambda: defaultdict(int))  # (group, kind) -> counters
        self.primitive_of = {}  # (group, kind) -> primitive name that ran

    # ---- accounting ----------------------------------------------------------------------
    def _count(self, name: str, kind: str, prim: str, tensor: torch.Tensor, logical: int) -> None:
        s = self.stats[(name, kind)]
        s["calls"] += 1
        s["logical_elems"] += LOGICAL_FACTOR[kind] * logical
        s["handed_elems"] += tensor.numel()
        s["handed_bytes"] += tensor.numel() * tensor.element_size()
        s["primitive_elems"] += PRIMITIVE_FACTOR[prim] * logical
        self.primitive_of[(name, kind)] = prim

    def reset(self) -> dict:
        """Return this step's counters ``{"group/kind": {...}}`` and start afresh."""
        out = {f"{g}/{k}": dict(v, primitive=self.primitive_of.get((g, k))) for (g, k), v in self.stats.items()}
        self.stats.clear()
        return out

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, name: str, logical: int | None = None, async_op: bool = True) -> Pending:
        """Sum ``t`` in place over group ``name`` (volume 2L)."""
        group, size, _ = self.groups[name]
        if size == 1:
            return Pending()
        self._count(name, "all_reduce", "all_reduce", t, t.numel() if logical is None else logical)
        return Pending(dist.all_reduce(t, group=group, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, name: str, logical: int | None = None,
                       async_op: bool = True) -> Pending:
        """``out`` (len L/N) <- this rank's chunk of the sum of ``inp`` (len L) over ``name``
        (volume L).  On gloo ``inp`` is used as scratch (it is all-reduced in place)."""
        group, size, rank = self.groups[name]
        if size == 1:
            out.copy_(inp)
            return Pending()
        prim = self.primitives["reduce_scatter"]
        self._count(name, "reduce_scatter", prim, inp, inp.numel() if logical is None else logical)
        n = out.numel()
        if prim == "all_reduce+slice":
            work = dist.all_reduce(inp, group=group, async_op=async_op)
            return Pending(work, lambda: out.copy_(inp[rank * n:(rank + 1) * n]))
        if prim == "reduce_scatter_list":
            return Pending(dist.reduce_scatter(out, list(inp.chunk(size)), group=group, async_op=async_op))
        return Pending(dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, name: str, logical: int | None = None,
                   async_op: bool = True, piece_elems: int | None = None) -> Pending:
        """``out`` (len L) <- concatenation of every rank's ``inp`` (len L/N) (volume L); the list
        form in pieces of ``piece_elems`` output elements (default ``list_gather_elems``)."""
        group, size, _ = self.groups[name]
        if size == 1:
            out.copy_(inp)
            return Pending()
        prim = self.primitives["all_gather"]
        self._count(name, "all_gather", prim, out, out.numel() if logical is None else logical)
        if prim == "all_gather_list":
            outs, n = out.chunk(size), inp.numel()
            step = max(1, (piece_elems or self.list_gather_elems) // size)
            works = [dist.all_gather([o[a:a + step] for o in outs], inp[a:a + step], group=group, async_op=async_op)
                     for a in range(0, n, step)]
            return Pending(_All(works) if async_op else None)
        return Pending(dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op))


def process_groups(topo, shared_params) -> tuple[dict, dict]:
    """``(groups, shared_of)``: the :class:`Collectives` groups ``name -> (group, size, rank)``
    ("dp", "mp", "world", "edp" (the expert-data-parallel group), then "tie0", "tie1", ... one per
    distinct group of ``shared_params``)
    and ``{param: tie-group name}``."""
    groups = {"dp": (topo.dp_cp_group, topo.dp_cp, topo.dp_cp_rank),  # DP x CP under context parallelism
              "mp": (topo.model_parallel_group, topo.tp * topo.pp, dist.get_rank(topo.model_parallel_group)),
              "world": (None, dist.get_world_size(), dist.get_rank())}
    if getattr(topo, "edp", None) is not None:
        groups["edp"] = (topo.expert_group("edp"), topo.edp, topo.edp_rank)
    shared_of, ties = {}, 0
    for p, g in shared_params:
        name = next((n for n, (gg, _, _) in groups.items() if gg is g and n.startswith("tie")), None)
        if name is None:
            name, ties = f"tie{ties}", ties + 1
            groups[name] = (g, dist.get_world_size(g), dist.get_rank(g))
        shared_of[p] = name
    return groups, shared_of
