"""Megatron-format log lines, TensorBoard scalars and the model-FLOPs throughput formula.

The per-iteration line (printed by the last rank, which owns the loss) is Megatron-LM's, field
for field, so existing log parsers keep working::

     iteration      100/    1000 | consumed samples:         3200 | elapsed time per iteration (ms): 512.3 | ...

TensorBoard scalars use Megatron's names (``lm loss``, ``learning-rate``, ``loss-scale``,
``grad-norm``, ``num-zeros``, ``params-norm``, ``batch-size``, ``iteration-time``, ``throughput``,
``lm loss validation``, ``lm loss validation ppl``), each also written as ``<name> vs samples``
against consumed samples; with ``--wandb-project`` the same names go to Weights & Biases.

Model FLOPs per iteration (Megatron's formula; forward + backward = 3 forward passes, 2 FLOPs per
multiply-add, causal attention counted in full)::

    F = 12 * B * s * L * h^2 * ( (1 + g/a + s/h) * (a * d / h)  +  (f / h) * m  +  V / (2 * L * h) )

with batch B (global), sequence s, layers L, hidden h, heads a, query groups g, head dim d,
FFN size f, m = 3/2 for SwiGLU (three matrices) else 1, and padded vocab V.
Throughput per GPU = F / (iteration time * world size) in TFLOP/s.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

from megazero.config.configs import WandbConfig
from megazero.model.mla_config import mla_attention_flops_per_token


def model_flops_per_iteration(config, batch_size: int, tp: int = 1) -> float:
    """The formula above for a :class:`~megazero.model.GPTConfig` and a global batch of
    ``batch_size`` sequences (``V`` padded for ``tp`` ranks). An MoE model's ``f`` is the mean over
    layers of the FFN width a token runs through: ``f`` for a dense layer, ``k f_moe + f_shared`` for
    an MoE one (Megatron-LM core_v0.20.0 ``num_floating_point_operations``); a multi-latent-attention
    layer's attention is Megatron's MLA term (:func:`~megazero.model.mla_config.mla_attention_flops_per_token`).
    Multi-token prediction (``D`` layers) adds, as Megatron-LM core_v0.16's ``num_floating_point_operations``
    ("MTP norms and proj", "Logit ... (mtp_num_layers + 1)"), ``6 B s D (3 h + 2 h^2)`` and ``D`` more
    logit terms ``6 B s h V`` -- and, as there, not the MTP transformer layers themselves."""
    B, s, L, h = batch_size, config.seq_length, config.num_layers, config.hidden_size
    a, g, d, f = config.num_attention_heads, config.num_query_groups, config.kv_channels, config.ffn_hidden_size
    m = 1.5 if config.activation == "swiglu" else 1.0
    moe = config.moe
    if moe is not None:  # Megatron: top-k routed experts plus the shared expert per MoE layer (no router)
        n_moe = moe.num_moe_layers
        f = (f * (L - n_moe) + (moe.ffn_hidden_size * moe.router_topk + (moe.shared_expert_intermediate_size or 0))
             * n_moe) / L
    V = config.padded_vocab(tp)
    attention = (1 + g / a + s / h) * (a * d / h)
    if config.multi_latent_attention:  # Megatron's MLA term (model/mla_config.py), in units of 12 h^2
        attention = mla_attention_flops_per_token(config) / (12.0 * h * h)
    D = config.mtp_num_layers or 0  # Megatron counts MTP's norms, eh_proj and D more logit layers, not its layers
    mtp = D * (3 * h + 2 * h * h) / (2.0 * L * h * h)
    return 12.0 * B * s * L * h * h * (attention + (f / h) * m + V * (1 + D) / (2.0 * L * h) + mtp)


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, iteration_ms: float,
                   tflops_per_gpu: float | None, lr: float | None, global_batch_size: int, losses: dict[str, float],
                   loss_scale: float, grad_norm: float | None, skipped: int, nans: int,
                   timestamp: str | None = None, params_norm: float | None = None,
                   decoupled_lr: float | None = None, num_zeros: float | None = None) -> str:
    """Megatron's per-iteration log line (core_v0.15.0 ``training_log``): ``timestamp`` as
    `` [%Y-%m-%d %H:%M:%S]`` first; throughput only with ``--log-throughput``
    (``tflops_per_gpu`` not None); ``losses`` may be empty (no successful step yet);
    ``global_batch_size``: the size of the iteration just run; ``num_zeros``
    (``--log-num-zeros-in-grad``, None for a skipped step) printed as Megatron's float (``12.0``)
    and ``params_norm`` (``--log-params-norm``) after the grad norm."""
    parts = [f" [{timestamp}]"] if timestamp is not None else []
    parts += [f" iteration {iteration:8d}/{train_iters:8d} |",
              f" consumed samples: {consumed_samples:12d} |",
              f" elapsed time per iteration (ms): {iteration_ms:.1f} |"]
    if tflops_per_gpu is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |")
    if lr is not None:
        parts.append(f" learning rate: {lr:.6E} |")
    if decoupled_lr is not None:
        parts.append(f" decoupled learning rate: {decoupled_lr:.6E} |")
    parts.append(f" global batch size: {global_batch_size:5d} |")
    parts += [f" {name}: {value:.6E} |" for name, value in losses.items()]
    parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    if num_zeros is not None:
        parts.append(f" num zeros: {float(num_zeros)} |")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f} |")
    parts += [f" number of skipped iterations: {skipped:3d} |", f" number of nan iterations: {nans:3d} |"]
    return "".join(parts)


class IntervalStats:
    """Megatron's ``total_loss_dict`` of ``training_log`` (core_v0.15.0): counters per log interval.

    Per iteration :meth:`add`: an applied step adds 1 to ``advanced`` and its loss to
    ``loss_sum``; a skipped one adds 1 to ``skipped`` and, if its loss is inf or NaN, 1 to
    ``nans`` (a skipped step whose loss is finite -- a gradient overflow -- is not a NaN
    iteration). :meth:`reset` after each printed line zeroes the counters and the loss sum. The
    printed ``lm loss`` is ``loss_sum / max(1, advanced)``, shown only if it is > 0: an interval
    without an applied step prints no ``lm loss`` at all.
    """

    def __init__(self):
        self.advanced = self.skipped = self.nans = 0
        self.loss_sum = None

    def add(self, applied: bool, loss=None, loss_is_nan: bool = False) -> None:
        if applied:
            self.advanced += 1
            if loss is not None:
                self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        else:
            self.skipped += 1
            self.nans += int(loss_is_nan)

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    def losses(self, loss_sum: float | None) -> dict[str, float]:
        """The ``lm loss`` entry to print from the (data-parallel reduced) ``loss_sum``."""
        if loss_sum is None:
            return {}
        avg = loss_sum / max(1, self.advanced)
        return {"lm loss": avg} if avg > 0.0 else {}

    def reset(self) -> None:
        self.advanced = self.skipped = self.nans = 0
        if self.loss_sum is not None:
            self.loss_sum = self.loss_sum * 0.0


def validation_line(iteration: int, loss: float, split: str = "validation", where: str = "") -> str:
    """Megatron's ``evaluate_and_print_results`` box; ``where`` (`` on test set``) follows the
    iteration as in its end-of-training evaluations."""
    ppl = math.exp(min(20.0, loss))
    text = f" {split} loss at iteration {iteration}{where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * (len(text) + 1)
    return f"{bar}\n{text}\n{bar}"


class TensorBoardLogger:
    """One ``SummaryWriter`` (created only on the rank that owns the loss) with paired scalars, and
    the W&B run of :func:`open_wandb` beside it: every scalar also goes to ``wandb.log({name:
    value, "samples vs steps": consumed}, step=iteration)`` (Megatron's names; W&B gets no
    ``vs samples`` copies, as Megatron's ``training_log``)."""

    def __init__(self, log_dir: str | None, enabled: bool, max_queue: int = 1000, wandb=None):
        self.writer, self.wandb = None, wandb
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def scalars(self, values: dict[str, float], iteration: int, consumed_samples: int | None) -> None:
        """Each value by iteration and, unless ``consumed_samples`` is None, ``<name> vs samples``."""
        values = {name: value for name, value in values.items() if value is not None}
        if self.wandb is not None and values:
            extra = {"samples vs steps": consumed_samples} if consumed_samples is not None else {}
            self.wandb.log({**values, **extra}, step=iteration)
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, iteration)
            if consumed_samples is not None:
                self.writer.add_scalar(f"{name} vs samples", value, consumed_samples)

    def text(self, name: str, text: str, iteration: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(name, text, iteration)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_wandb(wandb_config: WandbConfig, save: str | None, flags: Mapping, rank: int, world_size: int,
               print_fn=print):
    """Megatron's W&B writer (core_v0.19.0 ``megatron/training/global_vars.py``
    ``_set_wandb_writer``): with ``--wandb-project``, on the last rank only, ``wandb.init(dir=
    --wandb-save-dir or <--save>/wandb, name=--wandb-exp-name, project=--wandb-project,
    config=the flags, entity=--wandb-entity if given)``; returns the ``wandb`` module (for
    :class:`TensorBoardLogger`) or None. Without the ``wandb`` package (optional extra
    ``megazero[wandb]``) the flags have no effect and rank 0 prints one line saying so. As in
    Megatron, scalars reach W&B where TensorBoard's are written (give ``--tensorboard-dir`` too)."""
    project = wandb_config.project
    if not project or rank not in (0, world_size - 1):
        return None
    try:
        import wandb
    except ImportError:
        if rank == 0:
            print_fn(f"> --wandb-project {project}: the wandb package is not installed, nothing is sent to "
                     "Weights & Biases (pip install 'megazero[wandb]'; TensorBoard holds the same scalars)")
        return None
    if rank != world_size - 1:
        return None
    save_dir = wandb_config.save_dir or (os.path.join(save, "wandb") if save else None)
    kwargs = dict(dir=save_dir, name=wandb_config.exp_name, project=project, config=dict(flags))
    if wandb_config.entity:
        kwargs["entity"] = wandb_config.entity
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    wandb.init(**kwargs)
    return wandb
