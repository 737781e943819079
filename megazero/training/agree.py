"""The one small collective and the one host read of a training iteration.

Every scalar the ranks must agree on in an iteration travels in one packed fp32 tensor, summed
over the world once, and is read on the host once (``HostReads``), the read the optimizer needs
anyway to decide skip-or-step and the clipping coefficient:

======  ==========================================================================  =========
slot    this rank's contribution                                                    summed
======  ==========================================================================  =========
0       sum of squared unscaled gradients (``ZeroOptimizer.grad_partials``)         = |g|^2
(1)     zeros in the gradients (``--log-num-zeros-in-grad``, when logged)          = zeros
+0      loss sum of this log interval's earlier applied iterations (device-side)    x DP CP
+1      this iteration's loss (mean over its micro-batches)                         x DP CP
+2      1 (the ranks holding the loss: last pipeline stage, TP rank 0), else 0      = DP CP
+3      1 if this iteration's loss is inf/NaN                                       > 0: any
+4, +5  the exit signal and ``--exit-duration-in-mins`` flags                        > 0: any
+6      1 while this rank's ``--async-save`` write is still in flight                 > 0: any
+7...   ``extra`` (the MoE metrics, :mod:`.moe_log`), when given                       summed
...     ``reliability``: the result checks' slots (:mod:`.rerun`) and, on log          summed
        iterations with ``--log-straggler``, the straggler timings (:mod:`.stragglers`)
======  ==========================================================================  =========

The loss slots are divided by slot +2 (DP x CP: each CP rank's loss is CP times its share of the
sequence's token mean) on the host: the DP mean, as Megatron's
``average_losses_across_data_parallel_group``. When nothing but the norm is needed (no log or
TensorBoard line due, no exit flags, no checkpoint being written, no result checks: with
``--no-check-for-nan-in-loss-and-grad`` or fp16 dynamic loss scaling) only the norm partial is
reduced, over the optimizer's ``norm_group``; at ZeRO 0 with TP = PP = 1 that group has one rank
and no collective runs. The result checks (on by default, as Megatron-LM's NaN check) pack every
iteration: every rank must take the same branch on any rank's NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreed:
    """What every rank read from the iteration's packed sum (losses: DP means; None when the
    sum did not include them)."""

    total_sq: float
    zeros: float | None = None
    loss_before: float | None = None  # DP mean of the interval's earlier applied iterations' loss sum
    loss: float | None = None  # DP mean of this iteration's loss
    loss_not_finite: bool | None = None
    signalled: bool = False
    timed_out: bool = False
    writing: bool = False  # some rank's --async-save write is still in flight
    extra: tuple = ()  # the world sum of agree()'s ``extra`` (when packed)
    reliability: tuple = ()  # the world sum of agree()'s ``reliability``


class IterationAgreement:
    """Packs, reduces and reads an iteration's scalars (see the module docstring); keeps the
    device-side loss sum of the current log interval."""

    def __init__(self, topo, device, optimizer):
        self.topo, self.optimizer = topo, optimizer
        self.holds_loss = topo.is_last_stage and topo.tp_rank == 0
        self.interval_loss = torch.zeros(1, dtype=torch.float32, device=device)
        self.device = device

    def agree(self, loss: torch.Tensor | None, *, with_loss: bool, flags: tuple[bool, bool, bool] | None,
              count_zeros: bool = False, extra: torch.Tensor | None = None,
              reliability: torch.Tensor | None = None) -> Agreed:
        """After the schedule: one all-reduce and one host read (see the module docstring);
        ``flags``: this rank's (exit signal, exit duration, writing), slots +4 to +6; ``extra``
        (a device vector) joins the packed sum when it is packed (``with_loss``, flags or
        ``reliability``); ``reliability`` (a device vector) always packs."""
        opt = self.optimizer
        packed = with_loss or flags is not None or reliability is not None
        part = opt.grad_partials(over_world=packed or opt.norm_group == "world", count_zeros=count_zeros)
        if not packed:
            opt.comm.all_reduce(part, opt.norm_group, async_op=False)
            vals = opt.host.read(part)
            return Agreed(vals[0], vals[1] if count_zeros else None)
        k = part.numel()
        n_extra = extra.numel() if extra is not None else 0
        n_rel = reliability.numel() if reliability is not None else 0
        vec = torch.zeros(k + 7 + n_extra + n_rel, dtype=torch.float32, device=self.device)  # filled on the device
        if n_extra:
            vec[k + 7:k + 7 + n_extra].copy_(extra)
        if n_rel:
            vec[k + 7 + n_extra:].copy_(reliability)
        vec[:k].copy_(part)
        if self.holds_loss and loss is not None:
            mine = loss.detach().float().reshape(1)
            vec[k:k + 1].copy_(self.interval_loss)
            vec[k + 1:k + 2].copy_(mine)
            vec[k + 2].fill_(1.0)
            vec[k + 3:k + 4].copy_((~torch.isfinite(mine)).float())
        for slot, on in zip((k + 4, k + 5, k + 6), flags or (False, False, False)):
            if on:
                vec[slot].fill_(1.0)
        opt.comm.all_reduce(vec, "world", async_op=False)
        vals = opt.host.read(vec)
        holders = max(vals[k + 2], 1.0)
        return Agreed(vals[0], vals[1] if count_zeros else None, loss_before=vals[k] / holders,
                      loss=vals[k + 1] / holders, loss_not_finite=vals[k + 3] > 0,
                      signalled=vals[k + 4] > 0, timed_out=vals[k + 5] > 0, writing=vals[k + 6] > 0,
                      extra=tuple(vals[k + 7:k + 7 + n_extra]), reliability=tuple(vals[k + 7 + n_extra:]))

    def add_applied(self, loss: torch.Tensor | None) -> None:
        """After an applied step: its loss joins the interval's device-side sum (no host read)."""
        if self.holds_loss and loss is not None:
            self.interval_loss += loss.detach().float().reshape(1)

    def reset_interval(self) -> None:
        self.interval_loss.zero_()
