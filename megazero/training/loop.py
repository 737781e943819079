"""The pretraining loop: schedule step, ZeRO optimizer step, LR, evaluation, logs, checkpoints.

One iteration is one global batch: ``M = global_batch / (micro_batch * DP)`` micro-batches
through the selected pipeline schedule (no pipelining, 1F1B or interleaved 1F1B), gradient
reduction, the iteration's one packed all-reduce of its scalars (:mod:`.agree`) and the
(sharded) optimizer step, then the LR scheduler; ``M`` may change between iterations with a
batch-size schedule (:mod:`.batch_schedule`). Each pipeline stage reads only the micro-batch
entries it uses, ahead of time (:class:`~megazero.training.data.MicroBatchSource`). The last rank, which owns
the loss, prints Megatron's log line and writes TensorBoard. ``SIGTERM``/``SIGUSR1`` (sent by
SLURM before preemption) makes every rank save at the end of the current iteration and exit 0.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megazero.model.stages import gpt_forward_step
from megazero.parallel.topology import Topology
from megazero.pipeline.trace import ScheduleTrace, write_pipeline_trace
from megazero.training.agree import IterationAgreement
from megazero.training.batch_schedule import BatchSchedule
from megazero.training.checkpointing import TrainerCheckpoints, print_rank
from megazero.training.data import DocumentMasks, MicroBatchSource, stage_keys
from megazero.training.evaluation import TrainerEvaluation
from megazero.training.log_step import TrainerLogging, attention_backend
from megazero.training.logger import IntervalStats
from megazero.training.lr_schedule import LRScheduler, learning_rates
from megazero.training.signals import ExitSignal
from megazero.zero.norms import params_sq


class Trainer(TrainerLogging, TrainerEvaluation, TrainerCheckpoints):
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
        self.publications: list[tuple[int, int]] = []  # (checkpoint's iteration, published after iteration)
        self.exit_signal = None  # set by train()
        self.last_agreed = None  # the last iteration's agreed scalars (Agreed)
        self.batches = BatchSchedule.from_args(args, topo.dp)  # global batch size by consumed samples
        self.agreement = IterationAgreement(topo, device, optimizer)  # the one packed all-reduce per iteration
        self.stats = IntervalStats()  # Megatron's per-log-interval counters (training_log)
        self.start_time = time.time()  # --exit-duration-in-mins counts from here
        self.doc_masks = DocumentMasks.from_args(args, model_config.vocab_size)  # eod switches, or None
        if args.decoupled_lr is not None:  # Megatron: the embedding and output layer on their own LR
            from megazero.model.stages import embedding_and_output_params
            optimizer.set_decoupled_params(embedding_and_output_params(stages.chunks))

    def _source(self, dataset, consumed_samples: int, *, read_ahead: int, cycle: bool = False) -> MicroBatchSource:
        """This rank's micro-batches of ``dataset`` from ``consumed_samples`` on, read ahead on a
        background thread (``--num-workers`` > 0); only the entries this pipeline stage reads
        when the forward step is GPT's (another model's forward step gets every entry)."""
        keys = None
        if self.forward_step is gpt_forward_step:
            keys = stage_keys(self.topo, self.doc_masks, rope=self.model_config.position_embedding_type == "rope")
        return MicroBatchSource(dataset, consumed_samples, seq_length=self.args.seq_length,
                                micro_batch_size=self.args.micro_batch_size, topo=self.topo, device=self.device,
                                keys=keys, masks=self.doc_masks, cycle=cycle, read_ahead=read_ahead,
                                num_workers=getattr(self.args, "num_workers", 1))

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
            write_pipeline_trace(args.pipeline_trace, trace, print_fn=lambda s: print_rank(self.rank, 0, s))
        loss = self._local_loss(losses)
        agreed = self.agreement.agree(loss, with_loss=with_loss, flags=self._flags(),
                                      count_zeros=with_loss and bool(getattr(args, "log_num_zeros_in_grad", False)))
        ok, grad_norm = self.optimizer.apply_step(agreed.total_sq, *learning_rates(self.scheduler, args))
        return loss, ok, grad_norm, agreed

    def _flags(self) -> tuple[bool, bool, bool] | None:
        """This rank's (exit signal received, ``--exit-duration-in-mins`` passed, its
        ``--async-save`` write still in flight), or None when none of them can be on (no
        per-iteration agreement needed)."""
        args = self.args
        if self.exit_signal is None and args.exit_duration_in_mins is None and self.pending_save is None:
            return None
        minutes = (time.time() - self.start_time) / 60.0
        return (self.exit_signal is not None and self.exit_signal.received,
                args.exit_duration_in_mins is not None and minutes > args.exit_duration_in_mins,
                self.pending_save is not None and not self.pending_save.done())

    def _local_loss(self, losses) -> torch.Tensor | None:
        """This rank's mean micro-batch loss of one step (last stage only; no communication)."""
        if not self.topo.is_last_stage:
            return None
        return torch.stack([l.detach().float() for l in losses]).mean()

    # ---- the loop --------------------------------------------------------------------
    def train(self, exit_signal: ExitSignal | None) -> None:
        """Iterate to ``--train-iters``; ``exit_signal`` (``--exit-signal-handler``) makes every rank
        save and return at the end of the iteration in which any rank received the signal. Logged
        every ``--log-interval`` iterations as Megatron's ``training_log``; one host read per
        iteration (the packed scalars of :mod:`.agree`). The global batch size of an iteration is
        the batch schedule's at the samples consumed before it (Megatron's
        ``update_num_microbatches``); when its micro-batch count changes a checkpoint is saved
        first, as Megatron-LM core_v0.19.0 ``train`` does."""
        args, batches = self.args, self.batches
        self.first_iteration, self.exit_signal = self.iteration, exit_signal
        m_prev = batches.num_micro_batches(self.consumed_samples)
        if args.async_save and args.save:  # the writer's start and its buffer before the first step, not after a save
            self.prepare_async_save()
        with self._source(self.train_ds, self.consumed_samples, read_ahead=m_prev) as source:
            log_start = time.time()
            while self.iteration < args.train_iters:
                b, m = batches.global_batch_size(self.consumed_samples), batches.num_micro_batches(self.consumed_samples)
                if m != m_prev and args.save and self.iteration != 0:
                    self.save()
                m_prev = m
                mbs = source.next_batch(m, read_ahead=batches.num_micro_batches(self.consumed_samples + b))
                log_start = self._iteration(mbs, b, log_start)
                if self.pending_save is not None and not self.last_agreed.writing:
                    self.finish_save()  # every rank's file is written: publish now (Megatron's maybe_finalize_async_save)
                if self._save_or_exit(self.last_agreed):
                    self.finish_save()
                    return
        if args.save and not (args.save_interval and self.iteration % args.save_interval == 0):
            self.save()
        self.final_evaluation()
        self.finish_save()

    def _iteration(self, micro_batches: list[dict], batch_size: int, log_start: float) -> float:
        """One training iteration of ``batch_size`` samples and its counters, TensorBoard scalars,
        log line and evaluation when due; returns the start time of the current log interval."""
        args = self.args
        log_due = (self.iteration + 1) % args.log_interval == 0
        tb_due = bool(args.tensorboard_dir) and (self.iteration + 1) % args.tensorboard_log_interval == 0
        # fp16: a skipped step's DP-wide loss check travels in the same packed all-reduce
        loss, ok, grad_norm, agreed = self.train_step(micro_batches, with_loss=log_due or tb_due or args.fp16)
        self.last_agreed = agreed
        bad = agreed.loss_not_finite if agreed.loss_not_finite is not None else self._loss_not_finite(loss, ok)
        self.stats.add(ok, None, loss_is_nan=not ok and bad)
        self._count_step(ok, grad_norm, batch_size)
        # Megatron's optimizer reports no norm and no zeros for a skipped step
        params_norm = (log_due or tb_due) and getattr(args, "log_params_norm", False)
        extra = {"grad_norm": grad_norm if ok else None, "num_zeros": agreed.zeros if ok else None,
                 "params_norm": self._params_norm() if params_norm else None}
        if tb_due:
            self._tensorboard_step(agreed.loss, batch_size, **extra)
        if log_due:
            self._log((time.time() - log_start) / self.stats.iterations,
                      agreed.loss_before + (agreed.loss if ok else 0.0), batch_size, **extra)
            self.agreement.reset_interval()
            log_start = time.time()
        elif ok:
            self.agreement.add_applied(loss)
        if args.eval_interval and self.iteration % args.eval_interval == 0 and args.eval_iters > 0:
            self._log_validation(self.evaluate())
        return log_start

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
        if self.topo.dp > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.topo.dp_group)
        return bool(self.optimizer.host.read(bad)[0])

    def _count_step(self, ok: bool, grad_norm, batch_size: int) -> None:
        """After a step: iteration and sample counters; the LR schedule advances only on an
        applied step, by its global batch size (Megatron-LM's ``train_step``; a skipped
        fp16-overflow step leaves it where it was, as DeepSpeed's ``_take_model_step`` too)."""
        if ok:
            if isinstance(self.scheduler, LRScheduler):
                self.scheduler.step(batch_size)
            else:
                self.scheduler.step()
        self.iteration += 1
        self.consumed_samples += batch_size
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
            print_rank(self.rank, 0, f"exiting after iteration {self.iteration}: the run has lasted more than "
                                      f"--exit-duration-in-mins {args.exit_duration_in_mins}")
        signalled = signalled or timed_out
        exiting = signalled or bool(args.exit_interval and self.iteration % args.exit_interval == 0)
        due = bool(args.save_interval and self.iteration % args.save_interval == 0)
        if args.save and (due or exiting):
            self.save()
        if signalled and not timed_out:
            print_rank(self.rank, 0, f"exiting on signal after iteration {self.iteration}")
        elif exiting:
            print_rank(self.rank, 0, f"exiting at iteration {self.iteration} (--exit-interval {args.exit_interval})")
        return exiting
