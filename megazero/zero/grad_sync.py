"""Gradient synchronization of a :class:`~.optimizer.ZeroOptimizer`: per-parameter hooks add each
gradient into its region's flat buffer, and a region whose round is complete (every parameter
accumulated ``flush_every`` times: M at stages 0/1, 1 at stages 2/3) is reduced over DP at once,
overlapped with the rest of the backward (``overlap_comm``).

At stage >= 2 a round's full gradient (``L g`` bytes) is freed only when its reduction finishes,
so the reductions in flight are limited by bytes: after a launch, the oldest are waited for until
at most ``_inflight_budget`` bytes are in flight (the newest always stays: it overlaps the next
unit's backward). The budget is the largest non-root stage-3 unit's gradient (a layer's), so
besides the unit whose gradient is being produced about one layer's gradient is alive in flight.
At stage 2 it is one reduce bucket (``reduce_bucket_size`` gradient elements), not the largest
region: a parameter larger than the bucket (the vocabulary matrix) makes a region of its own, and
budgeting by it would let several ordinary buckets fly at once. Stages 0/1 keep their full
gradients anyway: no limit.

Weight-gradient accumulation fusion (:meth:`GradientSync.add_weight_grad`, Megatron's
``--gradient-accumulation-fusion``): a layer may add its weight gradient ``G^T X`` straight into
the region's fp32 flat gradient instead of handing autograd a ``p.grad`` in the parameters'
dtype."""

from __future__ import annotations

import torch

from .region import Region


class GradientSync:
    """Mixed into :class:`~.optimizer.ZeroOptimizer` (uses its ``regions``, ``gatherer``,
    ``overlap``, ``M``, ``stage``, ``grad_dtype``, ``params_dtype``, ``reduce_bucket_size``; sets ``_inflight``,
    ``_inflight_budget`` and ``_slots``)."""

    def _register_hooks(self, chunks) -> list:
        """Gradient hooks on every parameter, and the re-read of the masters after a chunk's
        ``load_state_dict`` (stage 3: through the gatherer, which also gathers for it)."""
        self._inflight = []  # [(pending reduction, bytes it keeps alive)]
        self._local_norms = None  # record_local_grad_norms(True): [norm of each flushed local gradient]
        self._inflight_budget = self._budget()
        self._slots = {id(p): (r, i) for r in self.regions for i, p in enumerate(r.params)}
        hooks = []
        if self.gatherer is not None:
            self.gatherer.hook_state_dicts(chunks, self.reload_model_params)
        else:
            hooks += [c.register_load_state_dict_post_hook(lambda m, k: self.reload_model_params()) for c in chunks]
        for r in self.regions:
            for i, p in enumerate(r.params):
                hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(r, i)))
        return hooks

    def _budget(self) -> float:
        """Bytes of freed-on-completion gradients allowed in flight (module docstring)."""
        if self.stage < 2:
            return float("inf")
        units = [u.region for u in self.gatherer.units if not u.root] if self.gatherer is not None else []
        sizes = [r.padded * r.grad_bytes for r in (units or self.regions) if not r.persistent_grad]
        if units:
            return max(sizes, default=0)
        bucket = self.reduce_bucket_size * self.grad_dtype.itemsize
        return min(max(sizes, default=0), bucket)  # stage 2: one bucket (a larger lone parameter's region waits)

    def _grad_hook(self, r: Region, i: int):
        def hook(p):
            self._synced = False
            self._counted(r, r.accumulate(i, p))
        return hook

    def _counted(self, r: Region, complete: bool) -> None:
        """After one accumulation was counted: reduce a complete round, release its unit."""
        if complete and r.shared is None:
            if r.flush_every == 1 or self.overlap:
                self._launch(r, async_op=self.overlap)
            if self.gatherer is not None and r.partitioned:
                self.gatherer.backward_done(r)

    @property
    def fuses_weight_grads(self) -> bool:
        """Whether :meth:`add_weight_grad` applies: half-precision parameters whose gradients
        accumulate in fp32 (in fp32 runs the fused and unfused sums are the same numbers)."""
        return self.grad_dtype == torch.float32 and self.params_dtype != torch.float32

    def add_weight_grad(self, p, grad_out: torch.Tensor, inp: torch.Tensor) -> bool:
        """Gradient accumulation fusion for ``Y = X W^T``: ``main_grad(W) += G^T X`` in fp32,
        ``G`` = ``grad_out`` ``[T, out]``, ``X`` = ``inp`` ``[T, in]`` (T tokens), straight into
        the region's flat gradient, with no ``W.grad`` (Megatron-LM's ``wgrad_gemm_accum_fp32``,
        megatron/core/tensor_parallel/layers.py). The caller returns no gradient for ``W``;
        ``W``'s ``AccumulateGrad`` still runs once per backward (with the other contributions,
        e.g. a tied embedding's lookup, or none) and its hook counts the accumulation as usual.
        Were it not run, the region is reduced by :meth:`finish_grad_sync` all the same.
        Returns False (nothing done: the caller returns ``W.grad``) for a parameter no region
        holds or without fp32 accumulation of half-precision parameters."""
        where = self._fused_slot(p)
        if where is not None:
            where[0].add_product(where[1], grad_out, inp)
        return where is not None

    def add_embedding_grad(self, p, ids: torch.Tensor, rows: torch.Tensor) -> bool:
        """The same fusion for an embedding table ``W``: ``main_grad(W)[ids] += G`` in fp32
        (``ids`` ``[T]``, ``rows`` = ``G`` ``[T, h]``), as :meth:`add_weight_grad`."""
        where = self._fused_slot(p)
        if where is not None:
            where[0].add_rows(where[1], ids, rows)
        return where is not None

    def _fused_slot(self, p):
        """``(region, index)`` of ``p`` when its weight gradient may be fused (then the step's
        gradients are no longer synced), else None."""
        where = self._slots.get(id(p)) if self.fuses_weight_grads else None
        if where is not None:
            self._synced = False
        return where

    def record_local_grad_norms(self, on: bool) -> None:
        """Keep the L2 norm of every local gradient a reduction is about to send (before the
        data-parallel collective: the norm of this rank's own contribution, as Megatron-LM's
        ``check_grads`` per bucket), as a device scalar; :meth:`take_local_grad_norms` hands them
        over. One extra pass over each reduced gradient, no host read."""
        self._local_norms = [] if on else None

    def take_local_grad_norms(self) -> list:
        """The local gradient norms recorded since the last call (device scalars, flush order)."""
        norms = self._local_norms or []
        if self._local_norms is not None:
            self._local_norms = []
        return norms

    def _launch(self, r: Region, async_op: bool) -> None:
        if self._local_norms is not None and r.full_grad is not None:
            self._local_norms.append(torch.linalg.vector_norm(r.full_grad, dtype=torch.float32))
        pending = r.flush(async_op=async_op)
        if not async_op:
            pending.wait()
            return
        self._inflight.append((pending, 0 if r.persistent_grad else r.padded * r.grad_bytes))
        while len(self._inflight) > 1 and sum(b for _, b in self._inflight) > self._inflight_budget:
            self._inflight.pop(0)[0].wait()

    def finish_grad_sync(self) -> None:
        """After the schedule: reduce what did not become ready, sum tied weights, wait for all."""
        if self._synced:
            return
        for r in self.regions:
            if r.shared is None and r.dirty:
                self._launch(r, async_op=True)
        for r in self.regions:
            if r.shared is not None:
                r.sum_shared()
                self._launch(r, async_op=True)
        while self._inflight:
            self._inflight.pop(0)[0].wait()
        if self.gatherer is not None:
            self.gatherer.end_of_step()
        self._synced = True

    def set_num_micro_batches(self, m: int) -> None:
        """A new number of micro-batches per step (a batch-size schedule): the regions that
        reduce after the M-th accumulation (stages 0/1, persistent and shared ones) now reduce
        after the ``m``-th. Call between steps."""
        m = int(m)
        if m == self.M:
            return
        for r in self.regions:
            if r.persistent_grad:  # the full gradient stays until the step: reduced after M
                r.flush_every = m
        self.M = m

    def zero_grad(self) -> None:
        """Drop any gradient accumulated since the last step (``step`` already leaves none)."""
        while self._inflight:
            self._inflight.pop(0)[0].wait()
        for r in self.regions:
            r.reset()
        self.take_local_grad_norms()  # a discarded step's norms go with its gradients
