"""ZeroEngine: DeepSpeed's training-engine calls over megazero's ZeRO, for any ``nn.Module``.

Semantics are DeepSpeed 0.19.8's ``DeepSpeedEngine`` (deepspeed/runtime/engine.py):

* ``engine(*args, **kw)`` calls the module (at stage 3 its units are gathered by forward hooks).
* ``engine.backward(loss)``: ``(loss / gradient_accumulation_steps * loss_scale).backward()``;
  a submodule with ``set_aux_loss_scale(scale)`` (megazero's GPTModel: MoE aux and MTP losses,
  added in backward) is first told ``loss_scale / gradient_accumulation_steps``, the same scale;
  the gradient hooks add each gradient into its flat region and reduce a region over DP once
  its round is complete (every micro-batch at stages 2/3, at the boundary at 0/1). Returns the
  unscaled loss, as DeepSpeed does.
* ``engine.step()``: counts one micro-step; at an accumulation boundary
  (``micro_steps % gradient_accumulation_steps == 0`` after the count) the optimizer steps
  (gradients divided by the loss scale and the DP size, global-norm clipping by
  ``gradient_clipping``, Adam(W) per param group), the LR scheduler steps unless fp16 overflowed
  (then the step is skipped, ``skipped_steps`` counts it), and ``global_steps`` increases.
* ``is_gradient_accumulation_boundary()``: whether the next ``step()`` is a boundary.

The gradient average over DP matches DeepSpeed's (``1/DP`` after a sum, with no prescaling).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.checkpoint import deepspeed_files, deepspeed_writer, engine as checkpoint
from .checks import check_unchanged, parameter_signature


class ZeroEngine(nn.Module):
    """Returned by :func:`megazero.initialize`; ``module`` is the user's model."""

    def __init__(self, module: nn.Module, optimizer, zero, scheduler, config, topo):
        super().__init__()
        self.module = module
        self.optimizer, self.zero, self.lr_scheduler, self.config, self.topo = optimizer, zero, scheduler, config, topo
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.global_samples = 0
        self._signature = parameter_signature(module)
        # modules whose auxiliary losses enter only in backward, with a gradient they are told
        # (``set_aux_loss_scale(scale)``: megazero's GPTModel for MoE aux and MTP losses)
        self._aux_scaled = [m for m in module.modules() if callable(getattr(m, "set_aux_loss_scale", None))]

    # ---- DeepSpeed's accessors ---------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    @property
    def dp_world_size(self) -> int:
        return self.topo.dp

    @property
    def global_rank(self) -> int:
        return self.topo.rank

    def get_lr(self) -> list[float]:
        """Every param group's learning rate for the next step (DeepSpeed's ``get_lr``)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        """The global gradient norm before clipping of the last step (None before any)."""
        return self.optimizer.last_grad_norm

    # ---- training ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        check_unchanged(self.module, self._signature)
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Scale by ``1 / gradient_accumulation_steps`` (unless ``scale_wrt_gas`` is False, as in
        DeepSpeed) and the fp16 loss scale, backward."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward(loss) needs a scalar loss tensor")
        if not loss.requires_grad:
            raise ValueError("engine.backward(loss): the loss does not require grad (was the forward run "
                             "under torch.no_grad() or engine.eval()?)")
        gas = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        for module in self._aux_scaled:  # losses added in backward (megazero's MoE aux, MTP) take the same scale
            module.set_aux_loss_scale(self.zero.loss_scale / gas)
        scaled = loss.float() * (self.zero.loss_scale / gas)
        scaled.backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """One micro-step; the optimizer and scheduler (``step(**lr_kwargs)``) step at an
        accumulation boundary (the parameter set was checked by this micro-step's forward)."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.config.micro_batch_size * self.topo.dp
        if not boundary:
            return
        stepped, _ = self.optimizer.step()
        if not stepped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (``step`` leaves none)."""
        self.optimizer.zero_grad()

    @property
    def loss_scale(self) -> float:
        return self.zero.scaler.scale

    def gathered_parameters(self):
        """A context in which every parameter is whole (stage 3), e.g. to read or save them."""
        return self.zero.gathered_params()

    def module_state_dict(self) -> dict:
        """The module's full ``state_dict`` (gathered at stage 3), cloned."""
        with self.zero.gathered_params():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    # ---- checkpoints (megazero.checkpoint.engine) -----------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, format: str = "megazero") -> str:
        """Every rank writes its part to ``save_dir/tag`` (default tag ``global_step{N}``, as
        DeepSpeed); collective. Returns the folder. ``format="megazero"`` (default): the engine's
        sharded files, loadable here at any DP size and stage; ``format="deepspeed"``: DeepSpeed
        0.19.8's files (ZeRO 1-3, fp16's dynamic scale and frozen parameters included), for
        DeepSpeed's ``zero_to_fp32`` and ``load_checkpoint`` at this DP size, each rank's partition
        exchanged from the shards (:mod:`megazero.checkpoint.deepspeed_writer`); opt-in, why:
        docs/checkpoints.md, "DeepSpeed's files". ``load_checkpoint`` reads both."""
        if not save_latest:
            raise ValueError("engine.save_checkpoint(save_latest=False) is not available: 'latest' is always written")
        if format not in ("megazero", "deepspeed"):
            raise ValueError(f"engine.save_checkpoint: format {format!r} is not 'megazero' or 'deepspeed'")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        if format == "deepspeed":
            return deepspeed_writer.save(self, save_dir, tag, client_state)
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True):
        """Load a checkpoint saved at any DP size, GAS or ZeRO stage; ``(folder, client_state)``.
        ``micro_steps`` becomes ``global_steps * gradient_accumulation_steps()`` (this run's GAS:
        :func:`megazero.engine.checkpoint.resumed_micro_steps`). A folder in DeepSpeed 0.19.8's
        layout (ZeRO 1/2/3, any DP size) is read by :mod:`megazero.checkpoint.deepspeed_files`."""
        ds_folder = deepspeed_files.folder_of(load_dir, tag)
        if ds_folder is not None:
            return deepspeed_files.load(self, ds_folder, load_optimizer_states, load_lr_scheduler_states)
        return checkpoint.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def destroy(self) -> None:
        """Remove every hook the engine registered on the module."""
        self.zero.close()
