"""ZeRO stage 3: parameters partitioned per *unit*, gathered just in time, freed after use.

A unit is a module whose parameters are gathered with one coalesced all-gather (volume L, over
DP).  Default units (:func:`find_units`): every child of an ``nn.ModuleList``/``ModuleDict`` (a
transformer layer), plus one unit on the chunk root for everything else (embedding, final norm,
head), which therefore stays gathered through the chunk's forward and, in backward, until the
chunk's ``root_backward_reads_end()`` module (GPT: the final norm, or a first stage's embedding)
has its input's gradient (the embedding: its output's), when that method exists (the embeddings'
backward reads no weight), else until its gradients are done. A layer unit is released in
backward once its inputs have their gradients (:mod:`.read_ends`): at the end of its ``B`` also
when a zero-bubble plan's ``W`` computes its weight gradients later (``W`` reads no weight: its
gradients still reach the region's hooks, which reduce them, at ``W``).

Per micro-batch a unit is gathered before its forward (forward pre-hook) and again before its
backward (hook on its outputs' gradients), and released after each, so one step with M
micro-batches moves ``M * (L + L + L)`` per unit: two all-gathers and one reduce-scatter (3Φ for
M = 1).  This is also what happens under a 1F1B pipeline, where a unit runs forward for several
micro-batches before their backwards: nothing stays resident between them unless the reuse
distance says so.  Knobs:

* ``prefetch_bucket_size``: after a unit is fetched, start async gathers of the next units in
  recorded execution order (reverse order in backward) until that many elements are in flight.
* ``max_live_parameters``: before a gather, release idle gathered units (oldest first) so at most
  this many elements are materialized (units in use are never released).
* ``max_reuse_distance``: after forward, a unit stays gathered if its backward comes within this
  many elements of other units' gathers (``2 * sum(sizes of later units in its chunk)``); after
  backward, if the next micro-batch's forward does (``2 * sum(sizes of earlier units)``).  The
  strict "<" makes 0 mean "always release" (the 3Φ configuration).
* persistence (``param_persistence_threshold``) is decided by the optimizer: small parameters go
  to an ordinary replicated region (stage-1 behaviour: gathered once per step, 2Φ_p).

Execution order is recorded during the first step (no prefetch until it is known).
"""

from __future__ import annotations

import torch
from torch import nn

from .collectives import Pending
from .read_ends import hook_inputs, hook_outputs, tensors_of


def find_units(chunk: nn.Module, modules=None) -> list[tuple[nn.Module, list]]:
    """Return ``[(module, trainable params it alone claims)]`` in module order.

    Default unit modules: the children of every ``nn.ModuleList``/``nn.ModuleDict`` (layers);
    ``modules`` replaces that list.  Every parameter no unit module covers (embedding, final norm,
    head, and weights used outside their own module, like a tied output projection) goes to one
    unit on the chunk itself, gathered for the chunk's whole forward and backward.
    """
    covered, units = set(), []

    def claim(mod, params):
        ps = [p for p in params if p.requires_grad and p not in covered]
        if ps:
            covered.update(ps)
            units.append((mod, ps))

    if modules is None:
        modules = [child for m in chunk.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
                   for child in (m.values() if isinstance(m, nn.ModuleDict) else m)]
    for m in modules:
        claim(m, m.parameters())
    claim(chunk, chunk.parameters())
    return units


class _Unit:
    __slots__ = ("index", "chunk", "region", "root", "in_fwd", "in_bwd", "hooked", "reads_none", "pending",
                 "stamp", "gathers")

    def __init__(self, index, chunk, region, root):
        self.index, self.chunk, self.region, self.root = index, chunk, region, root
        self.in_fwd = self.in_bwd = 0
        self.hooked = False  # its backward's end is a gradient hook's (read_ends), not its gradients'
        self.reads_none = False  # its backward reads none of its parameters (a first stage's embedding root)
        self.pending: Pending | None = None
        self.stamp = 0
        self.gathers = 0  # all-gathers issued for it (a count for tests and benchmarks)


class ParamGatherer:
    """Gathers and releases stage-3 units around their forward and backward."""

    def __init__(self, units, *, prefetch_bucket_size: int, max_live_parameters: int,
                 max_reuse_distance: int, overlap: bool):
        """``units``: list of ``(module, region, chunk index, is the chunk root)``; a root unit
        spans its chunk's whole forward and backward, so it is never prefetched."""
        self.units = [_Unit(i, c, r, root) for i, (_, r, c, root) in enumerate(units)]
        self.by_region = {id(u.region): u for u in self.units}
        self.prefetch, self.max_live, self.reuse = prefetch_bucket_size, max_live_parameters, max_reuse_distance
        self.overlap = overlap
        self.live = 0  # gathered elements (padded)
        self.peak_live = 0  # the most gathered at once (tests reset it to count a phase)
        self.clock = 0
        self.seen: list[int] = []  # first-step execution order (unit indices)
        self.order: dict[int, list[int]] | None = None  # chunk -> unit indices in forward order
        self.pos: dict[int, int] = {}
        self.handles = []
        for (module, _, _, root), unit in zip(units, self.units):
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
            self.handles.append(module.register_forward_hook(self._post_forward(unit), always_call=True))
            end = getattr(module, "root_backward_reads_end", None) if root else None
            boundary = end() if end is not None else (None if root else module)
            if boundary is not None:
                self.handles.append(boundary.register_forward_pre_hook(self._end_of_reads(unit), with_kwargs=True))
            if boundary is not None and root:
                self.handles.append(boundary.register_forward_hook(self._end_of_reads_after(unit)))

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, unit):
        def hook(module, args):
            if self.order is None and unit.index not in self.pos:
                self.pos[unit.index] = len(self.seen)
                self.seen.append(unit.index)
            self.fetch(unit)
            unit.in_fwd += 1
            self._prefetch_from(unit, +1)
        return hook

    def _post_forward(self, unit):
        """Also called when the forward raised (``always_call``): a recomputing checkpoint stops
        a layer's forward by an exception once it has what the backward saved (PyTorch's early
        stop), and an uncounted ``in_fwd`` kept the unit gathered until the step's end."""
        def hook(module, args, output):
            unit.in_fwd -= 1
            if torch.is_grad_enabled() and not unit.reads_none:  # reads_none: no gather for its backward
                fired = [False]

                def on_grad(grad):
                    if not fired[0]:
                        fired[0] = True
                        self.fetch(unit)
                        unit.in_bwd += 1
                        self._prefetch_from(unit, -1)
                for t in tensors_of(output):
                    if t.requires_grad:
                        t.register_hook(on_grad)
            self._maybe_release(unit, self._distance(unit, after_forward=True))
        return hook

    def _end_of_reads(self, unit):
        """The end of a unit's backward reads (:mod:`.read_ends`): a forward pre-hook on the unit's
        module (a layer), or on the module the chunk names for its root unit
        (``root_backward_reads_end()``, GPT: the final norm), that hooks the gradients of its
        inputs. Once they exist, that backward reads none of the unit's parameters: a layer's
        backward is over, and the rest of the chunk's backward reads none of the root's (the
        embedding's backward is ``dW[ids] += G``), so the unit is released then, not when its
        last gradient arrives (the tied embedding's; a deferred weight's, at the plan's ``W``):
        during the layers' backward the vocabulary matrix is not held (ZeRO-3, DP 2, 152M: 0.1 GB
        less at the step's peak), and under a zero-bubble plan no layer stays gathered from its
        ``B`` to its ``W``. Nothing is gathered more often: 2 all-gathers per micro-batch (1 for a
        first stage's embedding root, :meth:`_end_of_reads_after`)."""
        def hook(module, args, kwargs):
            hooked = hook_inputs(args, kwargs, lambda: self._end_backward(unit))
            unit.hooked = unit.hooked or hooked is not None
            return hooked
        return hook

    def _end_of_reads_after(self, unit):
        """The same on the named module's outputs when its inputs need no gradient (a first
        stage's embedding, whose input is token ids and whose backward reads no weight). Then
        the root's backward reads none of its parameters (the module the root names is where
        its reads end, and they end before they begin), so the root is not gathered for its
        backward (``reads_none``): a first stage saves one all-gather of its vocabulary matrix
        per micro-batch, and does not hold it through its layers' backward. Its gradients are
        still taken (``dW[ids] += G`` lands in the released parameter's full-shape ``.grad``)."""
        def hook(module, args, output):
            unit.reads_none = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            if unit.reads_none:
                unit.hooked = hook_outputs(output, lambda: self._end_backward(unit)) or unit.hooked
        return hook

    def backward_done(self, region) -> None:
        """The optimizer saw the unit's round complete: all its gradients for this micro-batch.
        The end of the backward for a unit without a gradient hook (:meth:`_end_of_reads`)."""
        unit = self.by_region.get(id(region))
        if unit is not None and not unit.hooked:
            self._end_backward(unit)

    def _end_backward(self, unit) -> None:
        """One backward of ``unit`` no longer reads its parameters: release unless reused soon."""
        unit.in_bwd = max(0, unit.in_bwd - 1)
        self._maybe_release(unit, self._distance(unit, after_forward=False))

    def unit_bytes(self) -> list[int]:
        """Each unit's gathered parameter bytes (``padded * p``): what one gather allocates."""
        return [u.region.padded * u.region.param_flat.element_size() for u in self.units]

    # ---- gather / release --------------------------------------------------------------------
    def fetch(self, unit) -> None:
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
        elif not unit.region.gathered:
            self._make_room(unit)
            unit.region.gather(async_op=False).wait()
            unit.gathers += 1
            self.live += unit.region.padded
            self.peak_live = max(self.peak_live, self.live)
        self.clock += 1
        unit.stamp = self.clock

    def _start(self, unit) -> None:
        if unit.region.gathered or unit.pending is not None:
            return
        if self.live + unit.region.padded > self.max_live:
            return
        unit.pending = unit.region.gather(async_op=True)
        unit.gathers += 1
        self.live += unit.region.padded
        self.peak_live = max(self.peak_live, self.live)

    def _release(self, unit) -> None:
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
        if unit.region.gathered:
            unit.region.release()
            self.live -= unit.region.padded

    def _make_room(self, unit) -> None:
        need = self.live + unit.region.padded - self.max_live
        if need <= 0:
            return
        idle = sorted((u for u in self.units if u is not unit and u.region.gathered and u.pending is None
                       and u.in_fwd == 0 and u.in_bwd == 0), key=lambda u: u.stamp)
        for u in idle:
            if need <= 0:
                break
            need -= u.region.padded
            self._release(u)

    def _maybe_release(self, unit, distance) -> None:
        if unit.in_fwd or unit.in_bwd or distance < self.reuse:
            return
        self._release(unit)

    def _distance(self, unit, after_forward: bool) -> float:
        if self.order is None:
            return float("inf")
        seq = self.order[unit.chunk]
        k = self.pos[unit.index]
        others = seq[k + 1:] if after_forward else seq[:k]
        return 2 * sum(self.units[i].region.padded for i in others)

    def _prefetch_from(self, unit, direction: int) -> None:
        if not self.overlap or self.order is None or self.prefetch <= 0:
            return
        seq = self.order[unit.chunk]
        k = self.pos[unit.index] + direction
        budget = 0
        while 0 <= k < len(seq) and budget < self.prefetch:
            nxt = self.units[seq[k]]
            if not nxt.root:
                budget += nxt.region.padded
                self._start(nxt)
            k += direction

    # ---- step boundary -----------------------------------------------------------------------
    def end_of_step(self) -> None:
        """Release everything (shards are about to change) and fix the execution order."""
        for u in self.units:
            self._release(u)
            u.in_fwd = u.in_bwd = 0
        if self.order is None and self.seen:
            self.order = {}
            for i in self.seen:
                self.order.setdefault(self.units[i].chunk, []).append(i)
            self.pos = {i: k for seq in self.order.values() for k, i in enumerate(seq)}
            for u in self.units:  # never run in the first step: no prefetch, release eagerly
                if u.index not in self.pos:
                    self.order.setdefault(u.chunk, [])
                    self.pos[u.index] = len(self.order[u.chunk])
                    self.order[u.chunk].append(u.index)

    def gather_all(self) -> None:
        for u in self.units:
            self.fetch(u)

    def hook_state_dicts(self, chunks, reload) -> None:
        """Make ``chunk.state_dict()`` / ``load_state_dict()`` see full parameters: gather all
        before; after ``state_dict`` clone the gathered tensors into the result and release;
        after ``load_state_dict`` re-read the shards (``reload()``) and release."""
        def pre(module, prefix, keep_vars):
            self.gather_all()

        def post(module, sd, prefix, local_metadata):
            ptrs = {u.region.param_flat.untyped_storage().data_ptr() for u in self.units}
            for k, v in sd.items():
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in ptrs:
                    sd[k] = v.clone()
            self.end_of_step()

        def load_pre(module, *args):
            self.gather_all()

        def load_post(module, incompatible_keys):
            reload()
            self.end_of_step()
        for c in chunks:
            self.handles += [c.register_state_dict_pre_hook(pre), c.register_state_dict_post_hook(post),
                             c.register_load_state_dict_pre_hook(load_pre),
                             c.register_load_state_dict_post_hook(load_post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

