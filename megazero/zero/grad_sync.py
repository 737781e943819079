"""Gradient synchronization of a :class:`~.optimizer.ZeroOptimizer`: per-parameter hooks add each
gradient into its region's flat buffer, and a region whose round is complete (every parameter
accumulated ``flush_every`` times: M at stages 0/1, 1 at stages 2/3) is reduced over DP at once,
overlapped with the rest of the backward (``overlap_comm``), with at most a few reductions in
flight at stage >= 2 (their buffers are freed as they finish)."""

from __future__ import annotations

from .region import Region


class GradientSync:
    """Mixed into :class:`~.optimizer.ZeroOptimizer` (uses its ``regions``, ``gatherer``,
    ``overlap``, ``M``, ``stage`` and the ``_inflight`` list)."""

    def _register_hooks(self, chunks) -> list:
        """Gradient hooks on every parameter, and the re-read of the masters after a chunk's
        ``load_state_dict`` (stage 3: through the gatherer, which also gathers for it)."""
        hooks = []
        if self.gatherer is not None:
            self.gatherer.hook_state_dicts(chunks, self.reload_model_params)
        else:
            hooks += [c.register_load_state_dict_post_hook(lambda m, k: self.reload_model_params()) for c in chunks]
        for r in self.regions:
            for i, p in enumerate(r.params):
                hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(r, i)))
        return hooks

    def _grad_hook(self, r: Region, i: int):
        def hook(p):
            self._synced = False
            if r.accumulate(i, p) and r.shared is None:
                if r.flush_every == 1 or self.overlap:
                    self._launch(r, async_op=self.overlap)
                if self.gatherer is not None and r.partitioned:
                    self.gatherer.backward_done(r)
        return hook

    def _launch(self, r: Region, async_op: bool) -> None:
        pending = r.flush(async_op=async_op)
        if not async_op:
            pending.wait()
            return
        self._inflight.append(pending)
        while len(self._inflight) > self._max_inflight:
            self._inflight.pop(0).wait()

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
            self._inflight.pop(0).wait()
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
            self._inflight.pop(0).wait()
        for r in self.regions:
            r.reset()
