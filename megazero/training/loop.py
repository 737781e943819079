"""The pretraining loop: schedule step, ZeRO optimizer step, LR, evaluation, logs, checkpoints.

One iteration is one global batch: ``M = global_batch / (micro_batch * DP)`` micro-batches
through the selected pipeline schedule (no pipelining, 1F1B or interleaved 1F1B), gradient
reduction, the iteration's one packed all-reduce of its scalars (:mod:`.agree`) and the
(sharded) optimizer step, then the LR scheduler; ``M`` may change between iterations with a
batch-size schedule (:mod:`.batch_schedule`). Each pipeline stage reads only the micro-batch
entries it uses, ahead of time (:class:`~megazero.training.data.MicroBatchSource`). The last rank, which owns
the loss, prints Megatron's log line and writes TensorBoard. ``SIGTERM``/``SIGUSR1`` (sent by
SLURM before preemption) makes every rank save at the end of the current iteration and exit 0.
The result checks and re-runs (:mod:`.rerun`, exit 16/17) and the straggler reports
(:mod:`.stragglers`) ride in the same packed all-reduce; docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from megazero.config.configs import RunConfig
from megazero.parallel.topology import Topology
from megazero.pipeline.trace import ScheduleTrace, write_pipeline_trace
from megazero.training.agree import IterationAgreement
from megazero.training.checkpointing import TrainerCheckpoints, print_rank
from megazero.training.data import DocumentMasks, MicroBatchSource
from megazero.training.evaluation import TrainerEvaluation
from megazero.training.faults import InjectedFaults
from megazero.training.log_step import TrainerLogging, attention_backend
from megazero.training.logger import IntervalStats
from megazero.optim.lr_schedule import LRScheduler, learning_rates
from megazero.training.moe_log import MoEMetricsLog
from megazero.training.rerun import EXIT_CODE_RESUME_TO_DISAMBIGUATE, RERUN, SLOTS, STOP, IterationGuard
from megazero.training.signals import ExitSignal
from megazero.training.stragglers import StragglerDetector


class Trainer(TrainerLogging, TrainerEvaluation, TrainerCheckpoints):
    """Owns everything one rank needs to train; built by :func:`pretrain`."""

    def __init__(self, config: RunConfig, topo: Topology, device: torch.device, *, stages, optimizer, runner,
                 forward_step, datasets, scheduler, tb):
        if forward_step is None:
            raise ValueError("no forward step: the model provider's ModelStages has none, and none was given")
        self.config, self.topo, self.device = config, topo, device
        self.model_config, self.stages, self.chunks = config.model, stages, stages.chunks
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
        self.batches = config.schedule.batches  # global batch size by consumed samples
        self.agreement = IterationAgreement(topo, device, optimizer)  # the one packed all-reduce per iteration
        self.stats = IntervalStats()  # Megatron's per-log-interval counters (training_log)
        self.moe_log = (MoEMetricsLog(stages.moe, config.model.moe, topo.dp, device, config.model.mtp_num_layers)
                        if stages.moe is not None and (config.model.moe or config.model.mtp_num_layers) else None)
        self.start_time = time.time()  # --exit-duration-in-mins counts from here
        self.doc_masks = DocumentMasks.from_config(config.data, config.model.vocab_size)  # eod switches, or None
        rel = config.reliability
        self.guard = IterationGuard(rel, self.rank, device, optimizer, stages.rng_states, config.seed)
        self.exit_code = 0  # 16/17 (a re-run's verdict, Megatron's codes), 1 (a NaN with --rerun-mode disabled)
        self.faults = InjectedFaults.from_env(self.rank)  # tests only: MEGAZERO_FAULTS
        self.stragglers = StragglerDetector(rel, self.rank, self.last_rank + 1, device) if rel.log_straggler else None
        self.straggler_reports: list = []  # (iteration, StragglerReport) on every rank
        step = self.faults.wrap(forward_step) if self.faults is not None else forward_step
        self._forward = self.stragglers.timed(step) if self.stragglers is not None else step

    def _source(self, dataset, consumed_samples: int, *, read_ahead: int, cycle: bool = False) -> MicroBatchSource:
        """This rank's micro-batches of ``dataset`` from ``consumed_samples`` on, read ahead on a
        background thread (``--num-workers`` > 0); only the entries this pipeline stage reads
        (``ModelStages.input_keys``) when the forward step is the model's own (another forward
        step gets every entry)."""
        keys, data = None, self.config.data
        if self.stages.input_keys is not None and self.forward_step is self.stages.forward_step:
            keys = self.stages.input_keys(self.doc_masks.per_document if self.doc_masks else frozenset())
        return MicroBatchSource(dataset, consumed_samples, seq_length=data.seq_length,
                                micro_batch_size=data.micro_batch_size, topo=self.topo, device=self.device,
                                keys=keys, masks=self.doc_masks, cycle=cycle, read_ahead=read_ahead,
                                num_workers=data.num_workers)

    # ---- one iteration -------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], with_loss: bool):
        """Schedule (forward/backward of every micro-batch), gradient sync, the iteration's one
        packed all-reduce and host read (:mod:`.agree`; ``with_loss``: a log or TensorBoard line
        is due, so the DP-mean loss travels in it), optimizer step. The result checks decide there,
        before the step, to apply it, to re-run the iteration (same micro-batches, same RNG) or to
        stop (:mod:`.rerun`: ``ok`` False, nothing applied, ``self.exit_code`` set). Returns
        ``(loss, ok, grad_norm, agreed)``; with ``--pipeline-trace`` the third step of this process
        is traced."""
        trace_path = self.config.logging.pipeline_trace
        steps_done = self.iteration - self.first_iteration
        traced = trace_path and steps_done == min(2, self.config.schedule.train_iters - self.first_iteration - 1)
        trace, guard, moe = ScheduleTrace() if traced else None, self.guard, self.stages.moe
        guard.begin(self.iteration)
        while True:
            if self.faults is not None:
                self.faults.at(guard.iteration, guard.run)
            loss, agreed = self._run(micro_batches, with_loss, trace)
            action = guard.decide(agreed.reliability[:SLOTS] if guard.checks is not None else ())
            if action != RERUN:
                break
            guard.restore()
            self.optimizer.discard_step()
            trace = None
            if moe is not None:
                moe.discard()
        if action == STOP:
            self.exit_code = guard.exit_code
            return loss, False, None, agreed
        if moe is not None:
            if self.config.model.moe is not None:
                moe.update_expert_bias(self.config.model.moe.bias_update_rate)
            self.moe_log.commit()
        ok, grad_norm = self.optimizer.apply_step(agreed.total_sq, *learning_rates(self.scheduler,
                                                                                   self.config.schedule.lr))
        return loss, ok, grad_norm, agreed

    def _run(self, micro_batches: list[dict], with_loss: bool, trace):
        """One run of the iteration up to its agreed host read: ``(local loss, Agreed)``."""
        self.optimizer.zero_grad()
        self.optimizer.set_num_micro_batches(len(micro_batches))
        moe = self.stages.moe
        if moe is not None:  # the aux losses' gradient: the LM loss's (Megatron's MoEAuxLossAutoScaler)
            moe.set_aux_scale(self.optimizer.loss_scale / len(micro_batches))
        with attention_backend(self.config.attention_backend, self.device):
            losses = self.runner.run(self.chunks, micro_batches, self._forward,
                                     grad_scale=self.optimizer.loss_scale, forward_only=False, trace=trace,
                                     weight_grad_stores=self.stages.weight_grad_stores)
        if moe is not None:
            self.moe_log.after_step(len(micro_batches))
        if trace is not None:
            write_pipeline_trace(self.config.logging.pipeline_trace, trace,
                                 print_fn=lambda s: print_rank(self.rank, 0, s))
        loss = self._local_loss(losses)
        self.optimizer.finish_grad_sync()  # every local gradient norm is recorded before the checks
        parts = [p for p in (self.guard.evaluate(losses),) if p is not None]
        report_due = self.stragglers is not None and self.guard.run == 0 and \
            (self.iteration + 1) % self.config.logging.log_interval == 0
        if report_due:
            parts.append(self.stragglers.slots(self.device))
        extra = self.moe_log.packed() if self.moe_log is not None and self.moe_log.size else None
        agreed = self.agreement.agree(loss, with_loss=with_loss, flags=self._flags(), extra=extra,
                                      reliability=torch.cat(parts) if parts else None,
                                      count_zeros=with_loss and self.config.logging.num_zeros_in_grad)
        if report_due:  # the iterations before this one (then this one starts the next interval)
            self._straggler_report(agreed.reliability[-self.stragglers.size():], len(micro_batches))
        if self.stragglers is not None:
            self.stragglers.end_iteration()
        return loss, agreed

    def _flags(self) -> tuple[bool, bool, bool] | None:
        """This rank's (exit signal received, ``--exit-duration-in-mins`` passed, its
        ``--async-save`` write still in flight), or None when none of them can be on (no
        per-iteration agreement needed)."""
        limit = self.config.schedule.exit_duration_in_mins
        if self.exit_signal is None and limit is None and self.pending_save is None:
            return None
        minutes = (time.time() - self.start_time) / 60.0
        return (self.exit_signal is not None and self.exit_signal.received,
                limit is not None and minutes > limit,
                self.pending_save is not None and not self.pending_save.done())

    def _local_loss(self, losses) -> torch.Tensor | None:
        """This rank's mean micro-batch loss of one step (last stage only; no communication)."""
        if not self.topo.is_last_stage:
            return None
        return torch.stack([l.detach().float() for l in losses]).mean()

    # ---- the loop --------------------------------------------------------------------
    def train(self, exit_signal: ExitSignal | None) -> int:
        """Iterate to ``--train-iters``; ``exit_signal`` (``--exit-signal-handler``) makes every rank
        save and return at the end of the iteration in which any rank received the signal. Returns
        the process exit code: 0, or a re-run's 16/17 (1: a NaN with ``--rerun-mode disabled``). Logged
        every ``--log-interval`` iterations as Megatron's ``training_log``; one host read per
        iteration (the packed scalars of :mod:`.agree`). The global batch size of an iteration is
        the batch schedule's at the samples consumed before it (Megatron's
        ``update_num_microbatches``); when its micro-batch count changes a checkpoint is saved
        first, as Megatron-LM core_v0.19.0 ``train`` does."""
        ck, batches, train_iters = self.config.checkpoint, self.batches, self.config.schedule.train_iters
        self.first_iteration, self.exit_signal = self.iteration, exit_signal
        m_prev = batches.num_micro_batches(self.consumed_samples)
        if ck.async_save and ck.save:  # the writer's start and its buffer before the first step, not after a save
            self.prepare_async_save()
        with self._source(self.train_ds, self.consumed_samples, read_ahead=m_prev) as source:
            log_start = time.time()
            while self.iteration < train_iters:
                b, m = batches.global_batch_size(self.consumed_samples), batches.num_micro_batches(self.consumed_samples)
                if m != m_prev and ck.save and self.iteration != 0:
                    self.save()
                m_prev = m
                with self.stragglers.data() if self.stragglers is not None else contextlib.nullcontext():
                    mbs = source.next_batch(m, read_ahead=batches.num_micro_batches(self.consumed_samples + b))
                log_start = self._iteration(mbs, b, log_start)
                if self.exit_code:  # a re-run's verdict: nothing of this iteration is applied or saved
                    self.finish_save()  # a checkpoint from before the fault may still be publishing
                    return self.exit_code
                if self.pending_save is not None and not self.last_agreed.writing:
                    self.finish_save()  # every rank's file is written: publish now (Megatron's maybe_finalize_async_save)
                if self._save_or_exit(self.last_agreed):
                    self.finish_save()
                    return self.exit_code
        if ck.save and not (ck.save_interval and self.iteration % ck.save_interval == 0):
            self.save()
        self.final_evaluation()
        self.finish_save()
        return self.exit_code

    def _iteration(self, micro_batches: list[dict], batch_size: int, log_start: float) -> float:
        """One training iteration of ``batch_size`` samples and its counters, TensorBoard scalars,
        log line and evaluation when due; returns the start time of the current log interval."""
        log, schedule = self.config.logging, self.config.schedule
        log_due = (self.iteration + 1) % log.log_interval == 0
        tb_due = bool(log.tensorboard_dir) and (self.iteration + 1) % log.tensorboard_log_interval == 0
        # fp16: a skipped step's DP-wide loss check travels in the same packed all-reduce
        fp16 = self.config.optimizer.params_dtype == torch.float16
        loss, ok, grad_norm, agreed = self.train_step(micro_batches, with_loss=log_due or tb_due or fp16)
        self.last_agreed = agreed
        if self.exit_code:
            return log_start
        bad = agreed.loss_not_finite if agreed.loss_not_finite is not None else self._loss_not_finite(loss, ok)
        self.stats.add(ok, None, loss_is_nan=not ok and bad)
        self._count_step(ok, grad_norm, batch_size)
        # Megatron's optimizer reports no norm and no zeros for a skipped step
        params_norm = (log_due or tb_due) and log.params_norm
        extra = {"grad_norm": grad_norm if ok else None, "num_zeros": agreed.zeros if ok else None,
                 "params_norm": self._params_norm() if params_norm else None}
        moe_console, moe_board = self._moe_metrics(agreed) if (tb_due or log_due) else ({}, {})
        if tb_due:
            self._tensorboard_step(agreed.loss, batch_size, moe=moe_board, **extra)
        if log_due:
            self._log((time.time() - log_start) / self.stats.iterations,
                      agreed.loss_before + (agreed.loss if ok else 0.0), batch_size, moe=moe_console, **extra)
            self.agreement.reset_interval()
            if self.moe_log is not None:
                self.moe_log.reset_interval()
            log_start = time.time()
        elif ok:
            self.agreement.add_applied(loss)
        if schedule.eval_interval and self.iteration % schedule.eval_interval == 0 and schedule.eval_iters > 0:
            self._log_validation(self.evaluate())
        return log_start

    def _moe_metrics(self, agreed) -> tuple[dict, dict]:
        """The MoE metrics (log line: interval means; TensorBoard: this iteration's) from the
        iteration's packed sum (:mod:`.moe_log`); empty for a dense model."""
        if self.moe_log is None or not agreed.extra:
            return {}, {}
        return self.moe_log.read(list(agreed.extra))

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
        schedule, ck = self.config.schedule, self.config.checkpoint
        signalled, timed_out = agreed.signalled, agreed.timed_out
        if self.guard.save_and_exit:  # --rerun-on-transient-error checkpoint_and_exit
            self.save()
            self.exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE
            print_rank(self.rank, 0, f"exiting with code {self.exit_code} after iteration {self.iteration}")
            return True
        if timed_out and not signalled:
            print_rank(self.rank, 0, f"exiting after iteration {self.iteration}: the run has lasted more than "
                                      f"--exit-duration-in-mins {schedule.exit_duration_in_mins}")
        signalled = signalled or timed_out
        exiting = signalled or bool(schedule.exit_interval and self.iteration % schedule.exit_interval == 0)
        due = bool(ck.save_interval and self.iteration % ck.save_interval == 0)
        if ck.save and (due or exiting):
            self.save()
        if signalled and not timed_out:
            print_rank(self.rank, 0, f"exiting on signal after iteration {self.iteration}")
        elif exiting:
            print_rank(self.rank, 0, f"exiting at iteration {self.iteration} (--exit-interval {schedule.exit_interval})")
        return exiting
