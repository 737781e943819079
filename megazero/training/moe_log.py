"""Megatron's MoE metrics in the log line and TensorBoard, riding the iteration's packed sum.

Megatron-core (core_v0.20.0 ``moe_logging.py`` ``MoEMetricsTracker``, called from
``training_log`` every iteration with ``loss_scale = 1 / num_microbatches``) keeps per layer the
sum over micro-batches of ``load_balancing_loss`` (aux loss / coeff), ``seq_load_balancing_loss``
and ``z_loss``; it sums them over the pipeline stages and the TP ranks of a sequence, averages
over DP (``z_loss`` over TP and DP), scales by ``1 / M`` and reports the mean over the MoE
layers: as a TensorBoard scalar of that name each iteration (``moe/<name>_layer_<n>`` per layer
with ``--moe-per-layer-logging``) and, like a loss, in the log line as ``<name>: v |`` averaged
over the log interval (it joins ``total_loss_dict``).

Here each rank's per-layer sums are divided by ``M * DP`` (``z_loss`` was recorded over TP
already), so their sum over the world is Megatron's value; the sums of this iteration and of the
log interval so far travel in the iteration's one packed all-reduce (:mod:`.agree`) when a log
or TensorBoard line is due, and are written then (TensorBoard at ``--tensorboard-log-interval``,
not every iteration: no extra collective).

Multi-token prediction (:mod:`megazero.model.mtp`) rides along: each depth's loss, recorded per
micro-batch as ``mtp_loss`` of depth ``k`` (a ``1/TP`` share per TP rank), is reported as
``mtp_<k+1> loss`` -- megatron-core 0.16.1 ``MTPLossLoggingHelper.track_mtp_metrics``: the sum
over micro-batches averaged over DP (x CP) and scaled by ``1 / M``, a TensorBoard scalar each
iteration and in the log line (via ``total_loss_dict``) averaged over the log interval. The MoE
means count the MTP layers among the MoE layers when they are MoE (Megatron's
``track_moe_metrics`` adds ``mtp_num_layers``).
"""

from __future__ import annotations

import torch

METRIC_COEFFS = (("load_balancing_loss", "aux_loss"), ("seq_load_balancing_loss", "seq_aux_loss"))


class MoEMetricsLog:
    """The MoE metrics of one rank's training run (see the module docstring)."""

    def __init__(self, state, moe, dp: int, device, mtp_num_layers: int | None = None):
        """``moe``: the model's MoEConfig (None: a dense model with multi-token prediction)."""
        self.state, self.moe, self.dp, self.mtp = state, moe, dp, mtp_num_layers or 0
        self.names = [name for name, kind in METRIC_COEFFS if moe is not None and moe.coeff(kind) > 0]
        if moe is not None and moe.z_loss_coeff:
            self.names.append("z_loss")
        if self.mtp:
            self.names.append("mtp_loss")
        L = state.num_layers
        self.current = torch.zeros(len(self.names), L, dtype=torch.float32, device=device)
        self.interval = torch.zeros_like(self.current)
        self.iterations = 0

    @property
    def size(self) -> int:
        """Elements this adds to the packed sum (0: nothing to log)."""
        return 2 * self.current.numel()

    def after_step(self, num_micro_batches: int) -> None:
        """Collect this run's sums from the routers (device ops only); a re-run of the iteration
        (:mod:`.rerun`) collects them again, :meth:`commit` counts the run that is applied."""
        sums = self.state.take()
        self.current.zero_()
        for i, name in enumerate(self.names):
            if name in sums:
                self.current[i] = sums[name] / (num_micro_batches * self.dp)

    def commit(self) -> None:
        """The iteration's run is final: its sums join the interval."""
        self.interval += self.current
        self.iterations += 1

    def packed(self) -> torch.Tensor:
        """This iteration's sums and the interval's including them (as after :meth:`commit`)."""
        return torch.cat([self.current.flatten(), (self.interval + self.current).flatten()])

    def _means(self, per_layer: torch.Tensor, divide: float) -> dict[str, float]:
        moe = self.moe
        n = max(1, moe.num_moe_layers + (self.mtp if moe.is_moe(len(moe.layer_pattern)) else 0)) if moe else 1
        out = {name: float(per_layer[i].sum()) / n / divide for i, name in enumerate(self.names) if name != "mtp_loss"}
        if self.mtp:
            out.update({f"mtp_{k + 1} loss": float(v) / divide for k, v in enumerate(per_layer[-1, :self.mtp].tolist())})
        return out

    def read(self, summed: list[float]) -> tuple[dict, dict]:
        """``(console, tensorboard)`` scalars from the world sums of :meth:`packed`: the interval
        mean for the log line, this iteration's for TensorBoard (with the per-layer values when
        ``--moe-per-layer-logging``)."""
        k = self.current.numel()
        shape = self.current.shape
        current = torch.tensor(summed[:k]).view(shape)
        interval = torch.tensor(summed[k:2 * k]).view(shape)
        console = self._means(interval, max(1, self.iterations))
        board = self._means(current, 1.0)
        if self.moe is not None and self.moe.per_layer_logging:
            for i, name in enumerate(self.names[:len(self.names) - (1 if self.mtp else 0)]):
                board.update({f"moe/{name}_layer_{n}": float(v) for n, v in enumerate(current[i].tolist())})
        return console, board

    def reset_interval(self) -> None:
        self.interval.zero_()
        self.iterations = 0
