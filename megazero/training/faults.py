"""Test-only fault injection into the values of a run: ``MEGAZERO_FAULTS``, read here and nowhere else.

Megatron's ``--error-injection-*`` flags (:mod:`.rerun`) reject a validation whose value is
fine; the faults below corrupt the values themselves, so the checks that must find them are
tested on real NaNs, spikes and slow ranks. Unset (always, outside tests) nothing is wrapped.

``MEGAZERO_FAULTS`` holds faults separated by ``;``, each ``kind:key=value:...``:

* ``nan_grad`` -- the backward of this rank's forward steps multiplies by NaN (its local gradients
  are NaN, its loss is not);
* ``nan_loss`` -- this rank's loss (last pipeline stage) is multiplied by NaN;
* ``spike_loss`` -- its loss is multiplied by ``factor`` (default 1000): loss and gradients spike;
* ``large_grad`` -- the backward multiplies by ``factor`` (default 1000), the loss is unchanged;
* ``slow`` -- each forward step sleeps ``seconds`` (default 0.05) first, inside what the straggler
  detector times (:mod:`.stragglers`).

Keys: ``rank`` (default 0), ``iteration`` (1-based, as logged; default every iteration) and
``runs``: ``1`` faults only the first run of the iteration (a transient fault: its re-run is
clean), ``all`` (default) every run, re-runs included (a persistent one).
"""

from __future__ import annotations

import os
import time

import torch

KINDS = ("nan_grad", "nan_loss", "spike_loss", "large_grad", "slow")
ENV = "MEGAZERO_FAULTS"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def parse(text: str) -> list[dict]:
    """The faults of a ``MEGAZERO_FAULTS`` value; ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, *pairs = part.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {part!r} (one of {', '.join(KINDS)})")
        fault = {"kind": kind, "rank": 0, "iteration": None, "runs": "all",
                 "factor": 1000.0, "seconds": 0.05}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in fault or key == "kind" or not value:
                raise ValueError(f"{ENV}: bad key {pair!r} in {part!r} (rank, iteration, runs, factor, seconds)")
            fault[key] = value if key == "runs" else float(value) if key in ("factor", "seconds") else int(value)
        if fault["runs"] not in ("1", "all"):
            raise ValueError(f"{ENV}: runs must be 1 or all in {part!r}")
        faults.append(fault)
    return faults


class InjectedFaults:
    """The faults of this rank; :meth:`at` says which iteration and run is going on."""

    def __init__(self, faults: list[dict], rank: int):
        self.faults = [f for f in faults if f["rank"] == rank]
        self.iteration = self.run = 0

    @classmethod
    def from_env(cls, rank: int, env=os.environ) -> "InjectedFaults | None":
        """None unless ``MEGAZERO_FAULTS`` names a fault for some rank."""
        text = env.get(ENV, "")
        return cls(parse(text), rank) if text.strip() else None

    def at(self, iteration: int, run: int) -> None:
        """The 1-based iteration and the run (0: first, 1: its re-run) about to start."""
        self.iteration, self.run = iteration, run

    def _active(self, kind: str):
        for f in self.faults:
            if f["kind"] == kind and f["iteration"] in (None, self.iteration) and (f["runs"] == "all" or self.run == 0):
                return f
        return None

    def wrap(self, forward_step):
        """``forward_step`` with this rank's active faults applied to its output."""
        def faulty(chunk, micro_batch, input_tensor):
            slow = self._active("slow")
            if slow is not None:
                time.sleep(slow["seconds"])
            out = forward_step(chunk, micro_batch, input_tensor)
            for kind, scale_forward in (("nan_loss", True), ("spike_loss", True), ("nan_grad", False),
                                        ("large_grad", False)):
                f = self._active(kind)
                if f is None or not torch.is_tensor(out) or not out.requires_grad:
                    continue
                factor = float("nan") if kind.startswith("nan") else f["factor"]
                if scale_forward and out.dim() == 0:
                    out = out * factor
                elif not scale_forward:
                    out = _ScaleGrad.apply(out, factor)
            return out
        return faulty
