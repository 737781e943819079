"""The training loop's evaluations: the validation set every ``--eval-interval`` iterations and
the validation and test sets at the end of training, as Megatron's ``evaluate_and_print_results``
(a mixin of :class:`megazero.training.loop.Trainer`)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TrainerEvaluation:
    """Evaluation methods of the Trainer (they read its ``config.schedule``, ``topo``, ``device``, ``chunks``,
    ``runner``, ``forward_step``, ``optimizer.host``, the datasets, ``_source`` and ``_local_loss``)."""

    def _dp_mean(self, step_losses: list) -> float | None:
        """Mean of several steps' local losses, averaged over the DP x CP group (a CP rank's loss
        is its share of the sequence's token mean, times CP): one all-reduce and one host read per
        log interval (or evaluation), on the last stage only. Every DP rank holds the same number
        of steps (skipped steps are skipped everywhere). With the V of ``--pipeline-schedule``
        zbv/dualpipev the loss is on pipeline rank 0 while the last rank prints it: one more
        all-reduce over the pipeline group brings it there (every rank calls this)."""
        v = self.topo.pp > 1 and getattr(self.topo, "pipeline_schedule", None) in ("zbv", "dualpipev")
        if not v and (not self.topo.is_last_stage or not step_losses):
            return None
        total = None
        if self.topo.is_last_stage and step_losses:
            total = torch.stack(step_losses).mean()
            if self.topo.dp_cp > 1:
                dist.all_reduce(total, group=self.topo.dp_cp_group)
                total /= self.topo.dp_cp
        if v:
            moved = total if total is not None else torch.zeros((), device=self.device)
            dist.all_reduce(moved, group=self.topo.pp_group)
            total = moved if self.topo.pp_rank in (0, self.topo.pp - 1) else None
        return None if total is None else self.optimizer.host.read(total)[0]

    def evaluate(self, dataset=None, start: int | None = None) -> float | None:
        """Mean loss over ``--eval-iters`` global batches of ``dataset`` (default: the validation
        set) from sample ``start`` (default: after the earlier evaluations' samples, as
        Megatron's ``consumed_valid_samples``); None on ranks without the loss or without data."""
        schedule = self.config.schedule
        dataset = self.valid_ds if dataset is None else dataset
        if dataset is None or schedule.eval_iters <= 0:
            return None
        for c in self.chunks:
            c.eval()
        if start is None:
            start = ((self.iteration // schedule.eval_interval) - 1) * schedule.eval_iters * schedule.global_batch_size
        m = schedule.num_micro_batches
        totals = []
        with torch.no_grad(), self._source(dataset, start % len(dataset), read_ahead=m, cycle=True) as source:
            for _ in range(schedule.eval_iters):
                mbs = source.next_batch(m, read_ahead=m)
                losses = self.runner.run(self.chunks, mbs, self.forward_step, grad_scale=1.0, forward_only=True)
                t = self._local_loss(losses)
                if t is not None:
                    totals.append(t)
        for c in self.chunks:
            c.train()
        return self._dp_mean(totals)

    def final_evaluation(self) -> None:
        """Megatron's ``pretrain`` after a completed ``train``: the validation set (its next
        ``--eval-iters`` batches) and the test set (from its first sample), printed as
        ``validation loss at iteration N on validation set`` / ``... on test set``."""
        schedule = self.config.schedule
        if schedule.eval_iters <= 0:
            return
        done = self.iteration // schedule.eval_interval if schedule.eval_interval else 0
        self._log_validation(self.evaluate(self.valid_ds, done * schedule.eval_iters * schedule.global_batch_size),
                             where=" on validation set")
        if self.test_ds is not None:
            self._log_validation(self.evaluate(self.test_ds, 0), where=" on test set", tensorboard=False)
