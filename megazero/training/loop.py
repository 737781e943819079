"""The pretraining loop: schedule step, ZeRO optimizer step, LR, evaluation, logs, checkpoints.

One iteration is one global batch: ``M = global_batch / (micro_batch * DP)`` micro-batches
through the selected pipeline schedule (no pipelining, 1F1B or interleaved 1F1B), gradient
reduction and the (sharded) optimizer step, then the LR scheduler. The last rank, which owns
the loss, prints Megatron's log line and writes TensorBoard. ``SIGTERM``/``SIGUSR1`` (sent by
SLURM before preemption) makes every rank save at the end of the current iteration and exit 0.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from megazero.checkpoint import files as ckpt
from megazero.parallel.launch import init_distributed
from megazero.training.logger import TensorBoardLogger, iteration_line, model_flops_per_iteration, validation_line
from megazero.training.lr_schedule import LRScheduler
from megazero.parallel.topology import Topology
from megazero.training.signals import ExitSignal
from megazero.training.build import (build_datasets, build_model_and_optimizer, micro_batch_iterator,
                                  restore_rng, rng_state, run_schedule)


def _print_rank(rank: int, target: int, text: str) -> None:
    if rank == target:
        print(text, flush=True)


class Trainer:
    """Owns everything one rank needs to train; built by :func:`pretrain`."""

    def __init__(self, args, topo: Topology, device: torch.device, model_provider=None, forward_step_func=None):
        self.args, self.topo, self.device = args, topo, device
        self.forward_step_func = forward_step_func
        self.rank, self.last_rank = dist.get_rank(), dist.get_world_size() - 1
        self.iteration, self.consumed_samples = 0, 0
        self.skipped, self.nans = 0, 0
        self.history: list[tuple[int, float]] = []  # (iteration, logged lm loss) on the last rank
        self.train_ds, self.valid_ds = build_datasets(args, topo)
        self.chunks, self.optimizer = build_model_and_optimizer(args, topo, device, model_provider)
        self.scheduler = LRScheduler(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                                     args.lr_decay_style)
        self.tb = TensorBoardLogger(args.tensorboard_dir, enabled=self.rank == self.last_rank)
        self.flops = model_flops_per_iteration(args)

    # ---- one iteration -------------------------------------------------------------
    def train_step(self, micro_batches: list[dict]) -> tuple[float | None, bool, float | None]:
        from megazero.pipeline.trace import trace_for_step, write_pipeline_trace
        args = self.args
        steps_done = self.iteration - self.first_iteration
        trace = trace_for_step(args, steps_done, at=min(2, args.train_iters - self.first_iteration - 1))
        self.optimizer.zero_grad()
        losses = run_schedule(args, self.chunks, micro_batches, self.topo, grad_scale=self.optimizer.loss_scale,
                              forward_only=False, trace=trace, forward_step_func=self.forward_step_func)
        if trace is not None:
            write_pipeline_trace(args.pipeline_trace, trace, self.topo,
                                 print_fn=lambda s: _print_rank(self.rank, 0, s))
        self.optimizer.finish_grad_sync()
        ok, grad_norm = self.optimizer.step(self.scheduler.get_lr())
        return losses, ok, grad_norm

    def _local_loss(self, losses) -> torch.Tensor | None:
        """This rank's mean micro-batch loss of one step (last stage only; no communication)."""
        if not self.topo.is_last_stage:
            return None
        return torch.stack([l.detach().float() for l in losses]).mean()

    def _dp_mean(self, step_losses: list) -> float | None:
        """Mean of several steps' local losses, averaged over the DP group: one all-reduce and one
        host read per log interval (or evaluation), on the last stage only. Every DP rank holds
        the same number of steps (skipped steps are skipped everywhere)."""
        if not self.topo.is_last_stage or not step_losses:
            return None
        total = torch.stack(step_losses).mean()
        if self.topo.dp > 1:
            dist.all_reduce(total, group=self.topo.dp_group)
            total /= self.topo.dp
        return total.item()

    def evaluate(self) -> float | None:
        args = self.args
        if self.valid_ds is None or args.eval_iters <= 0:
            return None
        for c in self.chunks:
            c.eval()
        start = ((self.iteration // args.eval_interval) - 1) * args.eval_iters * args.global_batch_size
        it = micro_batch_iterator(self.valid_ds, start % len(self.valid_ds), args, self.topo, self.device, cycle=True)
        totals = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                mbs = [next(it) for _ in range(args.num_micro_batches)]
                losses = run_schedule(args, self.chunks, mbs, self.topo, grad_scale=1.0, forward_only=True,
                                      forward_step_func=self.forward_step_func)
                t = self._local_loss(losses)
                if t is not None:
                    totals.append(t)
        for c in self.chunks:
            c.train()
        return self._dp_mean(totals)

    # ---- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        """Every rank writes its own file; rank 0 adds the gathered per-rank index (names, TP split
        rules, ZeRO regions) to ``metadata.json`` so any layout can load it (docs/checkpoints.md)."""
        from megazero.checkpoint.reshard import rank_index
        args = self.args
        with self.optimizer.gathered_params():  # ZeRO-3: materialize the partitioned parameters
            model = [{k: v.detach().clone() for k, v in c.state_dict().items()} for c in self.chunks]
        state = {"model": model, **({} if args.no_save_rng else {"rng": rng_state(self.chunks)}),
                 "scheduler": self.scheduler.state_dict(), "counters": {"skipped": self.skipped, "nans": self.nans}}
        if not args.no_save_optim:
            state["optimizer"] = self.optimizer.state_dict()
        index = rank_index(self.topo, self.chunks, self.optimizer)
        indices = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(index, indices, dst=0)
        metadata = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                    "layout": ckpt.layout_of(args), "args": ckpt.jsonable_args(args),
                    "index": {"version": 1, "ranks": indices}}
        t0 = time.time()
        path = ckpt.save_checkpoint(args.save, self.iteration, self.rank, state, metadata)
        _print_rank(self.rank, 0, f"saved checkpoint at iteration {self.iteration:7d} to {path} "
                                  f"in {time.time() - t0:.2f} s")

    def load(self) -> None:
        """Fast path (same layout and same regions): this rank's file as saved, RNG included.
        Otherwise reshard (megazero.checkpoint.reshard): each parameter's full tensor from the files that
        hold it, sliced for this rank's TP/PP/ZeRO shard; the RNG states are not restored."""
        from megazero.checkpoint.reader import CheckpointReader
        from megazero.checkpoint.reshard import check_model_shape, load_resharded, rank_index, same_layout
        args = self.args
        iteration = ckpt.latest_iteration(args.load)
        if iteration is None:
            _print_rank(self.rank, 0, f"no {ckpt.LATEST} in {args.load}: starting from scratch")
            return
        meta = ckpt.read_metadata(args.load, iteration)
        directory = ckpt.iteration_dir(args.load, iteration)
        if "index" not in meta:  # saved before resharding existed: same layout only
            ckpt.check_layout(meta["layout"], ckpt.layout_of(args), directory)
            fast = True
        else:
            reader = CheckpointReader(args.load, iteration)
            check_model_shape(reader, args)
            fast = same_layout(reader, ckpt.layout_of(args), rank_index(self.topo, self.chunks, self.optimizer))
            flags = torch.tensor([int(fast)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank takes the same path
            fast = bool(flags.item())
        t0 = time.time()
        self.load_path = "exact" if fast else "resharded"
        if fast:
            state = ckpt.load_rank_state(args.load, iteration, self.rank)
            if len(state["model"]) != len(self.chunks):
                raise ckpt.CheckpointError(f"{ckpt.rank_file(directory, self.rank)} holds {len(state['model'])} "
                                           f"model chunks, this run has {len(self.chunks)}")
            with self.optimizer.gathered_params():
                for chunk, sd in zip(self.chunks, state["model"]):
                    chunk.load_state_dict(sd)
                self.optimizer.reload_model_params()
            if not args.no_load_optim and "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_resharded(reader, self.chunks, self.optimizer, load_optim=not args.no_load_optim)
            state = reader.rank_state(0)  # scheduler and counters: the same on every rank
            _print_rank(self.rank, 0, f"resharded {directory} (saved as {meta['layout']}) into "
                                      f"{ckpt.layout_of(args)} in {time.time() - t0:.2f} s; note: RNG states "
                                      "are not restored across layouts, this run's --seed streams are used")
        if args.finetune:
            _print_rank(self.rank, 0, f"loaded weights from {args.load} iteration {iteration} (finetune: iteration 0)")
            return
        if state.get("scheduler") is not None:  # None: imported weights (tools/convert_checkpoint.py)
            self.scheduler.load_state_dict(state["scheduler"])
        if fast and not args.no_load_rng and "rng" in state:
            restore_rng(state["rng"], self.chunks)
        self.iteration, self.consumed_samples = meta["iteration"], meta["consumed_samples"]
        self.skipped, self.nans = state["counters"]["skipped"], state["counters"]["nans"]
        _print_rank(self.rank, 0, f"loaded checkpoint from {args.load} at iteration {iteration}")

    # ---- the loop --------------------------------------------------------------------
    def train(self, exit_signal: ExitSignal) -> None:
        args, topo = self.args, self.topo
        self.first_iteration = self.iteration
        it = micro_batch_iterator(self.train_ds, self.consumed_samples, args, topo, self.device)
        log_losses, log_start, log_iters = [], time.time(), 0
        stop_flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        while self.iteration < args.train_iters:
            mbs = [next(it) for _ in range(args.num_micro_batches)]
            losses, ok, grad_norm = self.train_step(mbs)
            self.scheduler.step()
            self.iteration += 1
            self.consumed_samples += args.global_batch_size
            if not ok:
                self.skipped += 1
                if grad_norm is not None and not math.isfinite(grad_norm):
                    self.nans += 1
            loss = self._local_loss(losses)
            if loss is not None and ok:
                log_losses.append(loss)
            log_iters += 1
            if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                self._log(self._dp_mean(log_losses), (time.time() - log_start) / log_iters, grad_norm)
                log_losses, log_start, log_iters = [], time.time(), 0
            if args.eval_interval and self.iteration % args.eval_interval == 0 and args.eval_iters > 0:
                val = self.evaluate()
                if self.rank == self.last_rank and val is not None:
                    print(validation_line(self.iteration, val), flush=True)
                    self.tb.scalars({"lm loss validation": val, "lm loss validation ppl": math.exp(min(20.0, val))},
                                    self.iteration, self.consumed_samples)
            stop_flag.fill_(1 if exit_signal.received else 0)
            dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
            signalled = bool(stop_flag.item())
            saved = False
            if args.save and (signalled or (args.save_interval and self.iteration % args.save_interval == 0)):
                self.save()
                saved = True
            if signalled:
                _print_rank(self.rank, 0, f"exiting on signal after iteration {self.iteration}")
                return
            if args.exit_interval and self.iteration % args.exit_interval == 0:
                if args.save and not saved:
                    self.save()
                _print_rank(self.rank, 0, f"exiting at iteration {self.iteration} (--exit-interval {args.exit_interval})")
                return
        if args.save and not (args.save_interval and self.iteration % args.save_interval == 0):
            self.save()

    def _log(self, lm: float | None, seconds_per_iter: float, grad_norm) -> None:
        args = self.args
        if self.rank != self.last_rank:
            return
        lm = float("nan") if lm is None else lm
        self.history.append((self.iteration, lm))
        tflops = self.flops / (seconds_per_iter * args.world_size * 1e12)
        lr = self.scheduler.get_lr(self.scheduler.num_steps - 1)
        scale = float(self.optimizer.loss_scale)
        print(iteration_line(iteration=self.iteration, train_iters=args.train_iters,
                             consumed_samples=self.consumed_samples, iteration_ms=seconds_per_iter * 1000,
                             tflops_per_gpu=tflops, lr=lr, global_batch_size=args.global_batch_size,
                             losses={"lm loss": lm}, loss_scale=scale, grad_norm=grad_norm,
                             skipped=self.skipped, nans=self.nans), flush=True)
        scalars = {"lm loss": lm, "learning-rate": lr, "loss-scale": scale, "grad-norm": grad_norm,
                   "batch-size": args.global_batch_size, "iteration-time": seconds_per_iter, "throughput": tflops}
        scalars.update(memory_scalars(self.device))
        scalars.update(self.optimizer.comm_scalars() if hasattr(self.optimizer, "comm_scalars") else {})
        self.tb.scalars(scalars, self.iteration, self.consumed_samples)


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


def setup(args, model_provider=None, forward_step_func=None) -> Trainer:
    """Start (or join) torch.distributed, build the topology and the trainer, load ``--load``."""
    launch, device = init_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    if launch.world_size != args.world_size:
        raise RuntimeError(f"launched with {launch.world_size} ranks but the arguments were validated for "
                           f"{args.world_size}")
    topo = Topology(args.world_size, launch.rank, tp=args.tensor_model_parallel_size,
                    pp=args.pipeline_model_parallel_size,
                    vp=args.virtual_pipeline_model_parallel_size or 1).create_groups()
    torch.manual_seed(args.seed + 100 * topo.pp_rank)
    np.random.seed(args.seed)
    trainer = Trainer(args, topo, device, model_provider, forward_step_func)
    if launch.rank == 0:
        print(f"> {topo.describe()}; data-parallel size {topo.dp}, {args.num_micro_batches} micro-batches per "
              f"step, ZeRO stage {args.zero_stage}, params {args.params_dtype}", flush=True)
    trainer.tb.text("arguments", "\n".join(f"    {k}: {v}" for k, v in sorted(vars(args).items())))
    if args.load:
        trainer.load()
    return trainer


def pretrain(args, model_provider=None, forward_step_func=None) -> int:
    """Entry point of ``pretrain_gpt.py``: train, and return the process exit code.

    Errors are printed with the failing rank; a checkpoint problem prints one line naming the
    file. The process group is torn down on the way out, so peers see a closed connection
    instead of waiting for the collective timeout.
    """
    exit_signal = ExitSignal.install((signal.SIGTERM, signal.SIGUSR1))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    try:
        trainer = setup(args, model_provider, forward_step_func)
        trainer.train(exit_signal)
        trainer.tb.close()
    except ckpt.CheckpointError as e:
        print(f"rank {rank}: checkpoint error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        print(f"rank {rank}: training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    return 0
