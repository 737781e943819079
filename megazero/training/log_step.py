"""The training loop's logging: Megatron's log line, TensorBoard scalars, validation lines
(a mixin of :class:`megazero.training.loop.Trainer`; the line's fields: docs/megatron.md), and the
``--attention-backend`` choice as SDPA backends."""

from __future__ import annotations

import contextlib
import math
from datetime import datetime

import torch
import torch.distributed as dist

from megazero.training.logger import iteration_line, model_flops_per_iteration, validation_line
from megazero.training.restart import write_progress
from megazero.optim.lr_schedule import learning_rates
from megazero.zero.norms import params_sq


class TrainerLogging:
    """Logging methods of the Trainer (they read its ``config``, ``stats``, ``scheduler``,
    ``optimizer``, ``tb``, ``rank``/``last_rank``, ``topo``)."""

    def _log(self, seconds_per_iter: float, loss_sum: float | None, batch_size: int, *, grad_norm: float | None,
             num_zeros: float | None = None, params_norm: float | None = None, moe: dict | None = None) -> None:
        """Megatron's line on the last rank; ``loss_sum``: the interval's applied iterations'
        DP-mean losses, summed (agreed in the iteration's packed all-reduce: no collective here);
        ``batch_size``: the global batch size of the iteration just run (Megatron's
        ``training_log`` prints ``get_current_global_batch_size()``), also the throughput's;
        ``num_zeros`` / ``params_norm`` with ``--log-num-zeros-in-grad`` / ``--log-params-norm``;
        ``moe``: the MoE metrics' interval means, printed after ``lm loss`` as Megatron's losses."""
        log, stats, world = self.config.logging, self.stats, self.config.parallel.world_size
        if self.rank == self.last_rank:
            losses = dict(stats.losses(loss_sum), **(moe or {}))
            self.history.append((self.iteration, losses.get("lm loss", float("nan"))))
            flops = model_flops_per_iteration(self.model_config, batch_size, self.topo.tp)
            tflops = flops / (seconds_per_iter * world * 1e12)
            print(iteration_line(iteration=self.iteration, train_iters=self.config.schedule.train_iters,
                                 consumed_samples=self.consumed_samples, iteration_ms=seconds_per_iter * 1000,
                                 tflops_per_gpu=tflops if log.throughput else None, lr=self.scheduler.get_lr(),
                                 decoupled_lr=learning_rates(self.scheduler, self.config.schedule.lr)[1],
                                 global_batch_size=batch_size, losses=losses,
                                 loss_scale=self.optimizer.scaler.scale, grad_norm=grad_norm,
                                 num_zeros=num_zeros, params_norm=params_norm,
                                 skipped=stats.skipped, nans=stats.nans,
                                 timestamp=datetime.now().strftime("%Y-%m-%d %H:%M:%S")), flush=True)
            self.tb.scalars({"skipped-iterations": stats.skipped, "nan-iterations": stats.nans},
                            self.iteration, self.consumed_samples)  # the line's interval counts (megazero's names)
            if log.timers_to_tensorboard:
                self.tb.scalars({"iteration-time": seconds_per_iter,
                                 "throughput": tflops if log.throughput else None},
                                self.iteration, self.consumed_samples)
            self._record_progress()
        stats.reset()

    def _record_progress(self) -> None:
        """With ``--save``: the iteration just logged, beside the checkpoints, for a restarted
        attempt to say what it redoes (:mod:`megazero.training.restart`). A folder that cannot be
        written is said once; the checkpoint's own save reports it as an error."""
        save = self.config.checkpoint.save
        if not save or getattr(self, "progress_unwritable", False):
            return
        try:
            write_progress(save, self.iteration, self.consumed_samples)
        except OSError as e:
            self.progress_unwritable = True
            print(f"WARNING: rank {self.rank}: cannot record progress in {save} ({e}); training goes on", flush=True)

    def _tensorboard_step(self, lm: float | None, batch_size: int, *, grad_norm: float | None,
                          num_zeros: float | None = None, params_norm: float | None = None,
                          moe: dict | None = None) -> None:
        """Every ``--tensorboard-log-interval`` iterations (Megatron's names, each also ``vs samples``):
        the iteration's DP-mean loss, learning rate, batch size, grad norm, loss scale (unless
        ``--no-log-loss-scale-to-tensorboard``), world size and memory (with their flags), the ZeRO
        communication counters. ``lm``: the iteration's DP-mean loss, agreed in its packed
        all-reduce (no collective here). ``moe``: the MoE metrics (Megatron writes them by iteration
        only, without a ``vs samples`` twin)."""
        log = self.config.logging
        if self.rank != self.last_rank:
            return
        scalars = {"learning-rate": self.scheduler.get_lr(), "batch-size": batch_size, "lm loss": lm,
                   "grad-norm": grad_norm,
                   "decoupled-learning-rate": learning_rates(self.scheduler, self.config.schedule.lr)[1],
                   "num-zeros": num_zeros, "params-norm": params_norm}
        if log.loss_scale_to_tensorboard:
            scalars["loss-scale"] = self.optimizer.scaler.scale
        if log.world_size_to_tensorboard:
            scalars["world-size"] = self.config.parallel.world_size
        if log.memory_to_tensorboard:
            scalars.update(memory_scalars(self.device))
        scalars.update(self.optimizer.comm_scalars())
        self.tb.scalars(scalars, self.iteration, self.consumed_samples)
        if moe:
            self.tb.scalars(moe, self.iteration, None)

    def _params_norm(self) -> float:
        """``--log-params-norm``: the L2 norm of the parameters after the step (Megatron's
        ``calc_params_l2_norm`` after ``train_step``): one more all-reduce and host read, on
        iterations with a log or TensorBoard line only."""
        sq = params_sq(self.optimizer, over_world=True)
        self.optimizer.comm.all_reduce(sq, "world", async_op=False)
        return math.sqrt(self.optimizer.host.read(sq)[0])

    def _loss_not_finite(self, loss, ok: bool) -> bool:
        """A skipped step's loss is inf/NaN on some data-parallel rank (Megatron checks the
        DP-reduced loss); the last stage only, and only on skipped steps whose iteration did not
        pack the loss into its agreement (an extra read, on fp16-overflow steps only)."""
        if loss is None or ok:
            return False
        bad = (~torch.isfinite(loss)).float().reshape(1)
        if self.topo.dp_cp > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.topo.dp_cp_group)
        return bool(self.optimizer.host.read(bad)[0])

    def _straggler_report(self, summed, num_micro_batches: int) -> None:
        """``--log-straggler``: the report of this log iteration (printed by rank 0, TensorBoard)."""
        batch = num_micro_batches * self.config.data.micro_batch_size * self.topo.dp
        report = self.stragglers.read(list(summed), model_flops_per_iteration(self.model_config, batch, self.topo.tp))
        if report is not None:
            self.straggler_reports.append((self.iteration + 1, report))
            self.tb.scalars(report.scalars(), self.iteration + 1, self.consumed_samples)

    def _log_validation(self, val: float | None, where: str = "", tensorboard: bool = True) -> None:
        """Megatron's validation box; ``where``: `` on test set`` etc. at the end of training."""
        if self.rank == self.last_rank and val is not None:
            print(validation_line(self.iteration, val, where=where), flush=True)
            if not tensorboard:
                return
            scalars = {"lm loss validation": val}
            if self.config.logging.validation_ppl_to_tensorboard:
                scalars["lm loss validation ppl"] = math.exp(min(20.0, val))
            self.tb.scalars(scalars, self.iteration, self.consumed_samples)


@contextlib.contextmanager
def attention_backend(name: str, device: torch.device):
    """``--attention-backend`` / ``--use-flash-attn`` as SDPA backends on CUDA: flash -> FLASH_ATTENTION,
    fused -> EFFICIENT_ATTENTION, unfused/local -> MATH; auto leaves SDPA's own choice (on CPU SDPA
    computes the same function whatever the name)."""
    if name == "auto" or device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "fused": SDPBackend.EFFICIENT_ATTENTION,
               "unfused": SDPBackend.MATH, "local": SDPBackend.MATH}[name]
    with sdpa_kernel([backend]):
        yield


def memory_scalars(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem-allocated-bytes": torch.cuda.memory_allocated(device),
                "mem-max-allocated-bytes": torch.cuda.max_memory_allocated(device),
                "mem-reserved-bytes": torch.cuda.memory_reserved(device)}
    try:
        import resource
        return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    except ImportError:
        return {}
