"""The per-iteration result checks of one rank, on the device (no host read, no collective).

Megatron-LM validates results where they are made (core_v0.19.0, commit 5be9626):
``pretrain_gpt.py`` ``loss_func`` checks each micro-batch's loss for NaN and Inf (fatal, tolerance
0) and, with ``--check-for-spiky-loss``, for a spike (``is_unexpectedly_large(threshold=10)``,
not fatal); ``megatron/core/distributed/param_and_grad_buffer.py`` ``check_grads`` checks each
gradient bucket's local norm, before the data-parallel collective, for NaN and Inf (fatal,
tolerance 0.001 for the non-deterministic attention backward) and, with
``--check-for-large-grads``, for a large value (threshold 10, not fatal).
``RerunStateMachine.is_unexpectedly_large`` (``megatron/core/rerun_state_machine.py``) takes the
largest ``|value|`` of the first 100 finite values of its kind (the "samples") and flags any later
value ``>= 10 x`` that maximum; NaN and Inf are never a spike (they are checked separately).

Here the same checks run on the values this rank has at the end of its backward: its last
stage's per-micro-batch losses (megazero's masked mean, not Megatron's masked sum: the same
ratio test, whatever the micro-batch's token count) and the norms of the local gradients ZeRO
was about to reduce (:meth:`~megazero.zero.ZeroOptimizer.record_local_grad_norms`; a "bucket"
is one flush of a ZeRO region). Every check's flags, in the fixed order of :data:`KINDS` and
element by element, form one flat vector; the rank's first flagged entry is its "failed
validation" (Megatron stops at a rank's first rejected call). :meth:`ResultChecks.packed` is what
joins the iteration's packed all-reduce (:mod:`.agree`): per kind, whether this rank's first
failure is of that kind and ``rank + 1`` if so, so the world sum counts the ranks and, for one
rank, names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("nan_loss", "inf_loss", "spiky_loss", "nan_grad", "inf_grad", "large_grads")
LOSS_KINDS = frozenset(KINDS[:3])
FATAL = frozenset({"nan_loss", "inf_loss", "nan_grad", "inf_grad"})
TOLERANCE = {k: (0.0 if k in LOSS_KINDS else 0.001) for k in KINDS}  # Megatron's, per call site
SPIKE_FACTOR = 10.0  # pretrain_gpt.py SPIKY_LOSS_FACTOR; check_grads' threshold
SAMPLES = 100  # is_unexpectedly_large's num_samples


def message(kind: str, index: int) -> str:
    """Megatron's ``message`` of the validation call (``index``: the micro-batch or bucket)."""
    where = f"bucket #{index} in backward pass before data-parallel communication collective"
    return {"nan_loss": "found NaN in local forward loss calculation",
            "inf_loss": "found Inf in local forward loss calculation", "spiky_loss": "Spiky loss",
            "nan_grad": f"found NaN in local grad norm for {where}", "inf_grad": f"found Inf in local grad norm for {where}",
            "large_grads": f"found unexpected large grads in {where}"}[kind]


class RunningMax:
    """``is_unexpectedly_large``'s state for one kind of value, on the device: the largest
    ``|value|`` of the first :data:`SAMPLES` finite values, and how many were sampled."""

    def __init__(self, device):
        self.max = torch.zeros((), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.float32, device=device)

    def flags(self, values: torch.Tensor) -> torch.Tensor:
        """Which of ``values`` (in the order they were made) are ``>= 10 x`` the sampled maximum;
        samples the first finite ones while fewer than :data:`SAMPLES` were taken."""
        v = values.abs().float()
        finite = torch.isfinite(v)
        seen = self.count + torch.cumsum(finite.float(), 0) - finite.float()  # finite values before each
        sample = finite & (seen < SAMPLES)
        self.max = torch.maximum(self.max, torch.where(sample, v, torch.zeros_like(v)).max())
        self.count = torch.clamp(self.count + sample.float().sum(), max=SAMPLES)
        return finite & ~sample & (v >= self.max * SPIKE_FACTOR)

    def state(self) -> tuple:
        return self.max.clone(), self.count.clone()

    def restore(self, state: tuple) -> None:
        self.max, self.count = state[0].clone(), state[1].clone()


@dataclass
class LocalResults:
    """One run's checked values on this rank: ``flags`` and ``values`` flat in :data:`KINDS`
    order, ``sizes`` the entries of each kind (0 for a check that is off or has no values here)."""

    flags: torch.Tensor  # bool
    values: torch.Tensor  # float32, the value each flag tested
    sizes: tuple[int, ...]

    def locate(self, index: int) -> tuple[str, int]:
        """``(kind, element)`` of a flat index."""
        for kind, n in zip(KINDS, self.sizes):
            if index < n:
                return kind, index
            index -= n
        raise IndexError(index)

    def index_of(self, kind: str, element: int) -> int:
        return sum(self.sizes[:KINDS.index(kind)]) + element


class ResultChecks:
    """The enabled checks of one rank (:class:`~megazero.config.configs.ReliabilityConfig`)."""

    def __init__(self, reliability, rank: int, device):
        self.cfg, self.rank, self.device = reliability, rank, device
        self.loss_max, self.grad_max = RunningMax(device), RunningMax(device)

    def evaluate(self, losses: list, norms: list) -> LocalResults:
        """This run's flags from its micro-batch losses (last stage; else empty) and local gradient
        norms; updates the spike samples (:meth:`state`/:meth:`restore` around a re-run)."""
        empty = torch.zeros(0, dtype=torch.float32, device=self.device)
        loss = torch.stack([l.detach().float().reshape(()) for l in losses]) if losses else empty
        grad = torch.stack(norms).float() if norms else empty
        cfg, parts = self.cfg, []
        for on, values, test in ((cfg.check_nan, loss, torch.isnan), (cfg.check_nan, loss, torch.isinf),
                                 (cfg.check_spiky_loss, loss, self.loss_max.flags),
                                 (cfg.check_nan, grad, torch.isnan), (cfg.check_nan, grad, torch.isinf),
                                 (cfg.check_large_grads, grad, self.grad_max.flags)):
            values = values if on else empty
            parts.append((test(values) if values.numel() else values.bool(), values))
        return LocalResults(torch.cat([f for f, _ in parts]), torch.cat([v for _, v in parts]),
                            tuple(v.numel() for _, v in parts))

    def packed(self, res: LocalResults) -> torch.Tensor:
        """``2 x len(KINDS)`` slots: per kind, 1 and ``rank + 1`` when this rank's first flagged
        entry is of that kind, else 0 (summed over the world: how many ranks, and which one)."""
        out = torch.zeros(2 * len(KINDS), dtype=torch.float32, device=self.device)
        if res.flags.numel() == 0:
            return out
        first = torch.argmax(res.flags.to(torch.uint8))  # the first True (0 when none)
        kind = torch.zeros((), dtype=torch.long, device=self.device)
        for end in list(_cumsum(res.sizes))[:-1]:  # device compares with host ints: no copy
            kind += (first >= end).long()
        onehot = (torch.arange(len(KINDS), device=self.device) == kind).float() * res.flags.any().float()
        out[0::2] = onehot
        out[1::2] = onehot * (self.rank + 1)
        return out

    def state(self) -> tuple:
        return self.loss_max.state(), self.grad_max.state()

    def restore(self, state: tuple) -> None:
        self.loss_max.restore(state[0])
        self.grad_max.restore(state[1])


def _cumsum(sizes):
    total = 0
    for n in sizes:
        total += n
        yield total


def compare(a, b: torch.Tensor) -> torch.Tensor:
    """Megatron's ``_compare_floats`` elementwise on the device (``a``: a float or a tensor of
    ``b``'s shape; no host read): 0 when equal (NaN equals NaN), inf when exactly one is NaN, or
    exactly one is Inf, or one NaN and the other Inf, else ``|2 (a - b) / (a + b)|`` (inf when
    ``a + b`` is 0; two opposite infinities, where Megatron's float arithmetic gives NaN, are inf)."""
    b = b.float()
    a = torch.full_like(b, a) if not torch.is_tensor(a) else a.float().expand_as(b)  # a fill: no copy
    nan_a, nan_b, inf_a, inf_b = torch.isnan(a), torch.isnan(b), torch.isinf(a), torch.isinf(b)
    equal = (a == b) | (nan_a & nan_b)
    mismatch = (nan_a ^ nan_b) | (inf_a ^ inf_b) | (nan_a & inf_b) | (inf_a & nan_b)
    rel = torch.nan_to_num(torch.abs((a - b) / (a + b) * 2), nan=float("inf"), posinf=float("inf"))
    inf = torch.full_like(b, float("inf"))
    return torch.where(equal, torch.zeros_like(b), torch.where(mismatch, inf, rel))


def compare_floats(a: float, b: float) -> float:
    """:func:`compare` on the host (for the messages), in plain Python as Megatron writes it."""
    nan_a, nan_b, inf_a, inf_b = math.isnan(a), math.isnan(b), math.isinf(a), math.isinf(b)
    if a == b or (nan_a and nan_b):
        return 0.0
    if nan_a != nan_b or inf_a != inf_b or (nan_a and inf_b) or (inf_a and nan_b) or a + b == 0:
        return math.inf
    rel = abs((a - b) / (a + b) * 2)
    return math.inf if math.isnan(rel) else rel
