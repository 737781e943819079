"""Overlap of the ZeRO 1/2 parameter all-gather with the next forward (``--overlap-param-gather``).

After the optimizer step every DP rank holds its updated shard of each stage 1/2 region; the
all-gather that rebuilds the full parameters (volume L per region) need not finish before the
step returns. It is launched for every region in forward order (regions are cut in reverse
execution order, so the last region is the first layer) and each module's forward pre-hook waits
only for the regions holding that module's own parameters, as Megatron-LM's distributed
optimizer does with ``--overlap-param-gather`` (megatron/core/distributed/
distributed_data_parallel.py, ``_make_forward_pre_hook``, core_v0.19.0). Anything that reads
parameters outside a forward (saving, loading, evaluation through another path) first calls
:meth:`ParamSync.wait_all`.
"""

from __future__ import annotations

class ParamSync:
    """In-flight parameter all-gathers of stage 1/2 regions and the hooks that wait for them."""

    def __init__(self, chunks, regions):
        region_of = {id(p): k for k, r in enumerate(regions) for p in r.params}
        self.pending: dict[int, object] = {}
        self._hooks = []
        for chunk in chunks:
            for module in chunk.modules():
                needed = sorted({region_of[id(p)] for p in module.parameters(recurse=False) if id(p) in region_of})
                if needed:
                    self._hooks.append(module.register_forward_pre_hook(self._waiter(tuple(needed))))

    def _waiter(self, needed: tuple):
        def hook(module, inputs):
            if self.pending:
                for k in needed:
                    work = self.pending.pop(k, None)
                    if work is not None:
                        work.wait()
        return hook

    def launch(self, regions) -> None:
        """Start every region's write-back, the first-executed region first; keep what is in flight."""
        self.wait_all()
        for k in reversed(range(len(regions))):
            work = regions[k].write_back(async_op=True)
            self.pending[k] = work

    def wait_all(self) -> None:
        """Finish every in-flight all-gather (before parameters are read outside a forward)."""
        pending, self.pending = self.pending, {}
        for work in pending.values():
            work.wait()

    def remove(self) -> None:
        self.wait_all()
        for h in self._hooks:
            h.remove()

