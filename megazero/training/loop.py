"""The pretraining loop: schedule step, ZeRO optimizer step, LR, evaluation, logs, checkpoints.

One iteration is one global batch: ``M = global_batch / (micro_batch * DP)`` micro-batches
through the selected pipeline schedule (no pipelining, 1F1B or interleaved 1F1B), gradient
reduction and the (sharded) optimizer step, then the LR scheduler. The last rank, which owns
the loss, prints Megatron's log line and writes TensorBoard. ``SIGTERM``/``SIGUSR1`` (sent by
SLURM before preemption) makes every rank save at the end of the current iteration and exit 0.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megazero.checkpoint import schema
from megazero.checkpoint.api import load_run, start_save
from megazero.parallel.topology import Topology
from megazero.pipeline.trace import ScheduleTrace, write_pipeline_trace
from megazero.training.agree import IterationAgreement
from megazero.training.data import DocumentMasks, micro_batch_iterator
from megazero.training.log_step import TrainerLogging, attention_backend
from megazero.training.logger import IntervalStats, model_flops_per_iteration
from megazero.training.lr_schedule import LRScheduler, learning_rates
from megazero.training.signals import ExitSignal


def _print_rank(rank: int, target: int, text: str) -> None:
    if rank == target:
        print(text, flush=True)


class Trainer(TrainerLogging):
    """Owns everything one rank needs to train; built by :func:`pretrain`."""

    def __init__(self, args, topo: Topology, device: torch.device, *, model_config, stages, optimizer, runner,
                 forward_step, datasets, scheduler, tb):
        self.args, self.topo, self.device = args, topo, device
        self.model_config, self.stages, self.chunks = model_config, stages, stages.chunks
        self.optimizer, self.runner, self.forward_step = optimizer, runner, forward_step
        self.train_ds, self.valid_ds, self.test_ds = (*datasets, None, None)[:3]  # test: optional
        self.scheduler, self.tb = scheduler, tb
        self.rank, self.last_rank = dist.get_rank(), dist.get_world_size() - 1
        self.iteration, self.consumed_samples = 0, 0
        self.skipped, self.nans = 0, 0
        self.history: list[tuple[int, float]] = []  # (iteration, logged lm loss) on the last rank
        self.first_iteration = 0  # where this process started (set again by train())
        self.pending_save = None  # --async-save: the checkpoint still being written
        self.exit_signal = None  # set by train()
        self.agreement = IterationAgreement(topo, device, optimizer)  # the one packed all-reduce per iteration
        self.flops = model_flops_per_iteration(model_config, args.global_batch_size, topo.tp)
        self.stats = IntervalStats()  # Megatron's per-log-interval counters (training_log)
        self.start_time = time.time()  # --exit-duration-in-mins counts from here
        self.doc_masks = DocumentMasks.from_args(args, model_config.vocab_size)  # eod switches, or None
        if args.decoupled_lr is not None:  # Megatron: the embedding and output layer on their own LR
            from megazero.model.stages import embedding_and_output_params
            optimizer.set_decoupled_params(embedding_and_output_params(stages.chunks))

    def _micro_batches(self, dataset, consumed_samples: int, cycle: bool = False):
        return micro_batch_iterator(dataset, consumed_samples, seq_length=self.args.seq_length,
                                    micro_batch_size=self.args.micro_batch_size, topo=self.topo,
                                    device=self.device, cycle=cycle, masks=self.doc_masks)

    # ---- one iteration -------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], with_loss: bool):
        """Schedule (forward/backward of every micro-batch), gradient sync, the iteration's one
        packed all-reduce and host read (:mod:`.agree`; ``with_loss``: a log or TensorBoard line
        is due, so the DP-mean loss travels in it), optimizer step. Returns ``(loss, ok,
        grad_norm, agreed)``; with ``--pipeline-trace`` the third step of this process is traced."""
        args = self.args
        steps_done = self.iteration - self.first_iteration
        traced = args.pipeline_trace and steps_done == min(2, args.train_iters - self.first_iteration - 1)
        trace = ScheduleTrace() if traced else None
        self.optimizer.zero_grad()
        self.optimizer.set_num_micro_batches(len(micro_batches))
        with attention_backend(args.attention_backend, self.device):
            losses = self.runner.run(self.chunks, micro_batches, self.forward_step,
                                     grad_scale=self.optimizer.loss_scale, forward_only=False, trace=trace)
        if trace is not None:
            write_pipeline_trace(args.pipeline_trace, trace, print_fn=lambda s: _print_rank(self.rank, 0, s))
        loss = self._local_loss(losses)
        agreed = self.agreement.agree(loss, with_loss=with_loss, flags=self._exit_flags(),
                                      count_zeros=with_loss and bool(getattr(args, "log_num_zeros_in_grad", False)))
        ok, grad_norm = self.optimizer.apply_step(agreed.total_sq, *learning_rates(self.scheduler, args))
        return loss, ok, grad_norm, agreed

    def _exit_flags(self) -> tuple[bool, bool] | None:
        """This rank's (exit signal received, ``--exit-duration-in-mins`` passed), or None when
        neither can stop the run (no per-iteration agreement needed)."""
        args = self.args
        if self.exit_signal is None and args.exit_duration_in_mins is None:
            return None
        minutes = (time.time() - self.start_time) / 60.0
        return (self.exit_signal is not None and self.exit_signal.received,
                args.exit_duration_in_mins is not None and minutes > args.exit_duration_in_mins)

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
        return self.optimizer.host.read(total)[0]

    def evaluate(self, dataset=None, start: int | None = None) -> float | None:
        """Mean loss over ``--eval-iters`` global batches of ``dataset`` (default: the validation
        set) from sample ``start`` (default: after the earlier evaluations' samples, as
        Megatron's ``consumed_valid_samples``); None on ranks without the loss or without data."""
        args = self.args
        dataset = self.valid_ds if dataset is None else dataset
        if dataset is None or args.eval_iters <= 0:
            return None
        for c in self.chunks:
            c.eval()
        if start is None:
            start = ((self.iteration // args.eval_interval) - 1) * args.eval_iters * args.global_batch_size
        it = self._micro_batches(dataset, start % len(dataset), cycle=True)
        totals = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                mbs = [next(it) for _ in range(args.num_micro_batches)]
                losses = self.runner.run(self.chunks, mbs, self.forward_step, grad_scale=1.0, forward_only=True)
                t = self._local_loss(losses)
                if t is not None:
                    totals.append(t)
        for c in self.chunks:
            c.train()
        return self._dp_mean(totals)

    # ---- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        """Every rank writes what it alone owns; rank 0 adds the gathered per-rank index (names, TP
        split rules, ZeRO regions) to ``metadata.json`` so any layout can load it
        (docs/checkpoints.md). ``--async-save``: the files are written in the background from
        host copies; a new save (or the end of :meth:`train`) first finishes the previous one."""
        args = self.args
        self.finish_save()
        self.optimizer.wait_params()
        t0 = time.time()
        pending = start_save(args.save, topo=self.topo, stages=self.stages, optimizer=self.optimizer,
                             scheduler_state=self.scheduler.state_dict(),
                             counters={"skipped": self.skipped, "nans": self.nans}, iteration=self.iteration,
                             consumed_samples=self.consumed_samples, layout=schema.layout_of(args),
                             saved_args={**schema.jsonable_args(args), **self.model_config.to_args(self.topo.tp)},
                             save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
                             background=args.async_save)
        if pending.thread is not None:
            self.pending_save = pending
            _print_rank(self.rank, 0, f"saving checkpoint at iteration {self.iteration:7d} to {pending.final} "
                                      f"in the background (snapshot {time.time() - t0:.2f} s)")
            return
        path = pending.finish()
        _print_rank(self.rank, 0, f"saved checkpoint at iteration {self.iteration:7d} to {path} "
                                  f"in {time.time() - t0:.2f} s")

    def finish_save(self) -> None:
        """Wait for the background checkpoint (if any) and publish it (collective); a failed write
        on any rank raises :class:`CheckpointError` here."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            path = pending.finish()
            _print_rank(self.rank, 0, f"saved checkpoint at iteration {pending.iteration:7d} to {path} "
                                      f"({time.time() - pending.started:.2f} s after it started)")

    def load(self) -> None:
        """Fast path (same layout and same regions): this rank's file as saved, RNG included.
        Otherwise reshard: each parameter's full tensor from the files that hold it, sliced for
        this rank's TP/PP/ZeRO shard; the RNG states are not restored (megazero.checkpoint.api)."""
        args = self.args
        self.optimizer.wait_params()
        loaded = load_run(args.load, topo=self.topo, stages=self.stages, optimizer=self.optimizer,
                          layout=schema.layout_of(args), model_config=self.model_config, device=self.device,
                          load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, finetune=args.finetune)
        if loaded is None:
            if args.exit_on_missing_checkpoint:
                _print_rank(self.rank, 0, f">> no checkpoint in --load {args.load} and --exit-on-missing-checkpoint "
                                          "is set: exiting")
                raise SystemExit(0)
            return
        self.load_path, self.load_bytes = loaded.path, loaded.bytes_read
        if loaded.scheduler is not None:  # None: finetune, or imported weights (tools/convert_checkpoint.py)
            self.scheduler.load_state_dict(loaded.scheduler)
        if loaded.counters is not None:
            self.skipped, self.nans = loaded.counters["skipped"], loaded.counters["nans"]
        self.iteration, self.consumed_samples = loaded.iteration, loaded.consumed_samples

    # ---- the loop --------------------------------------------------------------------
    def train(self, exit_signal: ExitSignal | None) -> None:
        """Iterate to ``--train-iters``; ``exit_signal`` (``--exit-signal-handler``) makes every rank
        save and return at the end of the iteration in which any rank received the signal. Logged
        every ``--log-interval`` iterations as Megatron's ``training_log``; one host read per
        iteration (the packed scalars of :mod:`.agree`)."""
        args = self.args
        self.first_iteration, self.exit_signal = self.iteration, exit_signal
        it = self._micro_batches(self.train_ds, self.consumed_samples)
        log_start = time.time()
        while self.iteration < args.train_iters:
            log_due = (self.iteration + 1) % args.log_interval == 0
            tb_due = bool(args.tensorboard_dir) and (self.iteration + 1) % args.tensorboard_log_interval == 0
            # fp16: a skipped step's DP-wide loss check travels in the same packed all-reduce
            loss, ok, grad_norm, agreed = self.train_step([next(it) for _ in range(args.num_micro_batches)],
                                                          with_loss=log_due or tb_due or args.fp16)
            bad = agreed.loss_not_finite if agreed.loss_not_finite is not None else self._loss_not_finite(loss, ok)
            self.stats.add(ok, None, loss_is_nan=not ok and bad)
            self._count_step(ok, grad_norm)
            grad_norm = grad_norm if ok else None  # Megatron's optimizer reports no norm for a skipped step
            if tb_due:
                self._tensorboard_step(agreed.loss, grad_norm)
            if log_due:
                self._log((time.time() - log_start) / self.stats.iterations, grad_norm,
                          agreed.loss_before + (agreed.loss if ok else 0.0))
                self.agreement.reset_interval()
                log_start = time.time()
            elif ok:
                self.agreement.add_applied(loss)
            if args.eval_interval and self.iteration % args.eval_interval == 0 and args.eval_iters > 0:
                self._log_validation(self.evaluate())
            if self._save_or_exit(agreed):
                self.finish_save()
                return
        if args.save and not (args.save_interval and self.iteration % args.save_interval == 0):
            self.save()
        self.final_evaluation()
        self.finish_save()

    def final_evaluation(self) -> None:
        """Megatron's ``pretrain`` after a completed ``train``: the validation set (its next
        ``--eval-iters`` batches) and the test set (from its first sample), printed as
        ``validation loss at iteration N on validation set`` / ``... on test set``."""
        args = self.args
        if args.eval_iters <= 0:
            return
        done = self.iteration // args.eval_interval if args.eval_interval else 0
        self._log_validation(self.evaluate(self.valid_ds, done * args.eval_iters * args.global_batch_size),
                             where=" on validation set")
        if self.test_ds is not None:
            self._log_validation(self.evaluate(self.test_ds, 0), where=" on test set", tensorboard=False)

    def _loss_not_finite(self, loss, ok: bool) -> bool:
        """A skipped step's loss is inf/NaN on some data-parallel rank (Megatron checks the
        DP-reduced loss); the last stage only, and only on skipped steps whose iteration did not
        pack the loss into its agreement (an extra read, on fp16-overflow steps only)."""
        if loss is None or ok:
            return False
        bad = (~torch.isfinite(loss)).float().reshape(1)
        if self.topo.dp > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.topo.dp_group)
        return bool(self.optimizer.host.read(bad)[0])

    def _count_step(self, ok: bool, grad_norm) -> None:
        """After a step: iteration and sample counters; the LR schedule advances only on an
        applied step, by its global batch size (Megatron-LM's ``train_step``; a skipped
        fp16-overflow step leaves it where it was, as DeepSpeed's ``_take_model_step`` too)."""
        if ok:
            if isinstance(self.scheduler, LRScheduler):
                self.scheduler.step(self.args.global_batch_size)
            else:
                self.scheduler.step()
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        if not ok:
            self.skipped += 1
            if grad_norm is not None and not math.isfinite(grad_norm):
                self.nans += 1

    def _save_or_exit(self, agreed) -> bool:
        """Save when due (``--save-interval``, a signal, ``--exit-interval``,
        ``--exit-duration-in-mins``); True to stop now. The two exit flags were agreed on in the
        iteration's packed all-reduce (:mod:`.agree`)."""
        args = self.args
        signalled, timed_out = agreed.signalled, agreed.timed_out
        if timed_out and not signalled:
            _print_rank(self.rank, 0, f"exiting after iteration {self.iteration}: the run has lasted more than "
                                      f"--exit-duration-in-mins {args.exit_duration_in_mins}")
        signalled = signalled or timed_out
        exiting = signalled or bool(args.exit_interval and self.iteration % args.exit_interval == 0)
        due = bool(args.save_interval and self.iteration % args.save_interval == 0)
        if args.save and (due or exiting):
            self.save()
        if signalled and not timed_out:
            _print_rank(self.rank, 0, f"exiting on signal after iteration {self.iteration}")
        elif exiting:
            _print_rank(self.rank, 0, f"exiting at iteration {self.iteration} (--exit-interval {args.exit_interval})")
        return exiting
