"""The rerun state machine of one training iteration (``--rerun-mode``), Megatron-LM's semantics.

Megatron-LM's ``RerunStateMachine`` (core_v0.19.0, commit 5be9626,
``megatron/core/rerun_state_machine.py``) validates results where they are made and, on a
rejected one, re-runs the iteration in place with the same micro-batches and the same RNG state
(``RERUNNING_IN_PLACE``), before the optimizer step. It compares the failed call's new result
with the first (``_compare_floats``: NaN equals NaN; tolerance 0 for the loss, 0.001 for the
gradients) and then, for a *fatal* check (NaN/Inf):

* not reproduced -- "Possible transient error": exit 17 (``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``)
  at once, saving nothing ("The job can be resumed from a previous checkpoint");
* reproduced -- a persistent fault of this GPU or a true divergence: it saves a checkpoint and
  exits 16 (``EXIT_CODE_RESUME_TO_DISAMBIGUATE``) so the job re-runs the iteration on another GPU,
  which ends in exit 17 either way ("Possible persistent error" or "Correct result");

and for a non-fatal one (spiky loss, large gradients) it continues with the re-run's result.
``--rerun-mode disabled`` checks without re-running (a fatal hit raises: exit 1);
``report_stats`` re-runs every iteration once and reports how much each checked value varied
(every 2 iterations), never stopping. ``--error-injection-rate N`` rejects one validation call
in N (``(randint(0, N-1) + rank) % N == 0``, at most one pending per rank, never in a process's
first iteration) and forces the re-run's comparison: ``transient_error`` a mismatch,
``persistent_error`` / ``correct_result`` a match.

megazero (docs/reliability.md): the checks are :mod:`.result_checks`', on the device; their flags
travel in the iteration's one packed all-reduce (:mod:`.agree`), so every rank takes the same
branch at the host read the optimizer step waits for anyway, before the parameters change. A
reproduced NaN/Inf stops with exit 17 and saves nothing: megazero does not re-run from a
checkpoint on another node (resuming the last checkpoint elsewhere makes the same diagnosis by
hand). A transient one is followed by ``--rerun-on-transient-error``: ``continue`` (default: the
re-run's result is valid and is applied), ``exit`` (Megatron's exit 17) or
``checkpoint_and_exit`` (apply, save, exit 16: the job restarts off the suspect node). A re-run
that flags a NaN/Inf of its own is never applied (exit 17). The checks run from the first
iteration (Megatron skips a process's first iteration because its exit-16 checkpoint needs a step
taken; no megazero exit saves at the fault).
"""

from __future__ import annotations

import os
import random

import torch

from megazero.checkpoint.rng import restore_rng, rng_state
from megazero.training.rerun_report import QuickStats, report_stats, who
from megazero.training.result_checks import FATAL, KINDS, TOLERANCE, ResultChecks, compare, compare_floats, message

APPLY, RERUN, STOP = "apply", "rerun", "stop"
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
REPORTING_INTERVAL_ITERATIONS = 2
SLOTS = 2 * len(KINDS) + 4  # per kind (ranks, rank + 1 sum); the re-run's (fatal, non-fatal) x (same, new)
EXITING = "Exiting now. The job can be resumed from a previous checkpoint"


class ErrorInjector:
    """Megatron's ``RerunErrorInjector`` (``--error-injection-rate``, ``--error-injection-type``):
    draws from its own generator (seeded by ``--seed``), not the training RNG."""

    NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
             "persistent_error": "Persistent error"}

    def __init__(self, rate: int, kind: str, rank: int, seed: int):
        self.rate, self.kind, self.rank = rate, kind, rank
        self.random = random.Random(seed)
        self.injected = None  # the pending injection's type

    def choose(self, calls: int) -> int | None:
        """The validation call (of ``calls`` this run) whose result is rejected, or None."""
        if not self.rate or self.injected is not None:
            return None
        for call in range(calls):
            if (self.random.randint(0, self.rate - 1) + self.rank) % self.rate == 0:
                self.injected = self.kind
                print(f"Injecting error type {self.NAMES[self.kind]}", flush=True)
                return call
        return None

    def forced_mismatch(self) -> bool:
        """``maybe_miscompare`` in the in-place re-run: a transient injection mismatches (and is
        done); a persistent or correct one matches and stays pending (Megatron clears it in the
        re-run from a checkpoint, which megazero has not: no further injection in this process)."""
        if self.injected == "transient_error":
            self.injected = None
            return True
        return False


class Failure:
    """This rank's failed validation: its flat index, kind, element, first value, injected or not."""

    def __init__(self, index: int, kind: str, element: int, value: float, injected: bool):
        self.index, self.kind, self.element, self.value, self.injected = index, kind, element, value, injected


class IterationGuard:
    """Checks each run of an iteration and decides: apply its step, re-run it, or stop."""

    def __init__(self, cfg, rank: int, device, optimizer, rng_states, seed: int):
        self.cfg, self.rank, self.device, self.optimizer, self.rng_states = cfg, rank, device, optimizer, rng_states
        self.checks = ResultChecks(cfg, rank, device) if cfg.any_check else None
        self.reruns = self.checks is not None and cfg.rerun_mode != "disabled"
        self.injector = ErrorInjector(cfg.error_injection_rate, cfg.error_injection_type, rank, seed)
        optimizer.record_local_grad_norms(cfg.check_nan or cfg.check_large_grads)
        self.where = f"Rank {rank}, node {os.uname()[1]}, device {device.index if device.type == 'cuda' else 'cpu'}"
        self.iteration = self.run = self.begun = self.exit_code = 0
        self.save_and_exit, self.failed, self.saved, self.res = False, None, None, None
        self.stats: dict[str, QuickStats] = {}
        if self.checks is not None and cfg.rerun_mode == "validate_results" and rank == 0:
            print("Result validation enabled", flush=True)

    # ---- one run ---------------------------------------------------------------------------
    def begin(self, iterations_done: int) -> None:
        """Before the iteration's first run: keep what a re-run must start from (every RNG this
        rank draws from, the spike samples)."""
        self.iteration, self.run, self.failed, self.injected_call = iterations_done + 1, 0, None, None
        self.begun += 1
        if self.reruns:
            self.saved = (rng_state(self.rng_states), self.checks.state())

    def restore(self) -> None:
        """Before a re-run: the RNG and spike samples as :meth:`begin` kept them."""
        restore_rng(self.saved[0], self.rng_states)
        self.checks.restore(self.saved[1])
        self.run += 1

    def evaluate(self, losses: list) -> torch.Tensor | None:
        """This run's :data:`SLOTS` for the packed all-reduce (None: no check is on): the checks
        of its losses and local gradient norms, an injected rejection, and in a re-run whether
        this rank's failed call came out the same."""
        if self.checks is None:
            return None
        res = self.res = self.checks.evaluate(losses, self.optimizer.take_local_grad_norms())
        if self.run == 0 and self.begun > 1:  # Megatron injects nothing in a process's first iteration
            self.injected_call = self.injector.choose(res.flags.numel())
            if self.injected_call is not None:
                res.flags[self.injected_call] = True
        rerun = torch.zeros(4, dtype=torch.float32, device=self.device)
        f = self.failed
        if self.run > 0 and f is not None:
            if f.injected:
                mismatch = torch.full((), float(self.injector.forced_mismatch()), device=self.device)
            else:
                mismatch = (compare(f.value, res.values[f.index]) > TOLERANCE[f.kind]).float()
            base = 0 if f.kind in FATAL else 2
            rerun[base] = 1.0 - mismatch
            rerun[base + 1] = mismatch
        return torch.cat([self.checks.packed(res), rerun])

    # ---- the decision at the agreed host read ----------------------------------------------
    def decide(self, slots) -> str:
        """APPLY, RERUN or STOP (``exit_code`` set) from the world sums of :meth:`evaluate`'s slots."""
        if self.checks is None:
            return APPLY
        counts, ranks = slots[0:2 * len(KINDS):2], slots[1:2 * len(KINDS):2]
        flagged, mode = any(c > 0 for c in counts), self.cfg.rerun_mode
        if self.run == 0:
            if flagged:
                self.first_who = who(counts, ranks)
                self._read_failure(mode)
            if mode == "report_stats":
                self.initial = self.res.values.clone()
                return RERUN
            if not flagged:
                return APPLY
            if mode == "disabled":
                fatal = any(c > 0 for k, c in zip(KINDS, counts) if k in FATAL)
                self.exit_code = 1 if fatal else 0
                return STOP if fatal else APPLY
            self._print0("Need to rerun step to check reproducibility of initial result")
            return RERUN
        if mode == "report_stats":
            self._record_stats()
            return APPLY
        return self._verdict(counts, slots[2 * len(KINDS):])

    def _read_failure(self, mode: str) -> None:
        """On a flagged iteration only (one extra host read per rank): this rank's first flagged
        call, printed as Megatron prints it (``disabled``: its RuntimeError's text)."""
        res = self.res
        if res.flags.numel() == 0:
            return
        first = torch.argmax(res.flags.to(torch.uint8))
        hit, index, value = self.optimizer.host.read(torch.stack([res.flags.any().float(), first.float(),
                                                                  res.values[first].float()]))
        if not hit:
            return
        index = int(index)
        kind, element = res.locate(index)
        injected = index == self.injected_call
        if self.injected_call is not None and not injected:
            self.injector.injected = None  # a real rejection came first: Megatron would not have drawn
        self.failed = Failure(index, kind, element, value, injected)
        text = message(kind, element)
        if mode == "disabled":
            print(f"{self.where}, iteration {self.iteration}: Unexpected result {value} (message='{text}')", flush=True)
        else:
            invocation = element + 1 if kind in ("nan_loss", "inf_loss", "spiky_loss") else 1
            print(f"Unexpected result {value} on rank {self.rank} at iteration #{self.iteration} "
                  f"invocation #{invocation} (message='{text}')", flush=True)

    def _verdict(self, counts, rerun) -> str:
        """After the in-place re-run (validate_results): see the module docstring."""
        fatal_same, fatal_new, _, _ = rerun
        self._print_comparison()
        rerun_fatal = any(c > 0 for k, c in zip(KINDS, counts) if k in FATAL)
        if fatal_same > 0 or rerun_fatal:
            self._print0(EXITING)
            self._print0(f"> iteration {self.iteration} not applied, nothing saved ({self.first_who}: the NaN/Inf "
                         f"{'came back in' if fatal_same > 0 else 'was followed by another in'} the re-run); the last "
                         "checkpoint holds the state before it. Resume it on other nodes: a fault that comes back "
                         "is the data or the model (a true divergence), one that does not was that node's "
                         "(Megatron-LM saves and exits 16 to make this re-run itself)")
            self.exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION
            return STOP
        if fatal_new > 0:
            return self._transient()
        self._print0("Continuing normal execution because failed validation was not fatal")
        return APPLY

    def _transient(self) -> str:
        action = self.cfg.on_transient
        if action == "exit":
            self._print0(EXITING)
            self.exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION
            return STOP
        if action == "checkpoint_and_exit":
            self._print0(f"> iteration {self.iteration}: a transient fault ({self.first_who}); applying the re-run's "
                         "result, then saving a checkpoint and exiting 16 so the job restarts off that node")
            self.save_and_exit = True
            return APPLY
        self._print0(f"> iteration {self.iteration}: a transient fault ({self.first_who}): the re-run's result is "
                     "valid and is applied (--rerun-on-transient-error continue)")
        return APPLY

    def _print_comparison(self) -> None:
        """The failed rank's line on its re-run (Megatron's ``log_failure`` text)."""
        f = self.failed
        if f is None:
            return
        value = self.optimizer.host.read(self.res.values[f.index])[0]
        same = (f.injected and self.injector.injected is not None) or (
            not f.injected and compare_floats(f.value, value) <= TOLERANCE[f.kind])
        head = f"{self.where}, iteration #{self.iteration}: "
        if same:
            print(f"{head}First rerun: unexpected result is reproducible within the tolerance ({value} = {f.value}). "
                  "Need to rerun on a different GPU to verify correctness.!", flush=True)
        else:
            print(f"{head}First rerun: unexpected result is not reproducible within the tolerance "
                  f"({value} != {f.value})!", flush=True)
            print(f"{head}Possible transient error!!", flush=True)

    def _record_stats(self) -> None:
        """report_stats: each checked value's relative change in the re-run (one host read)."""
        res = self.res
        if res.values.numel():
            diffs = self.optimizer.host.read(compare(self.initial, res.values))
            for i, d in enumerate(diffs):
                self.stats.setdefault(message(*res.locate(i)), QuickStats()).record(d)
        if (self.iteration - 1) % REPORTING_INTERVAL_ITERATIONS == 0:
            report_stats(self.stats, self.rank)

    def _print0(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)
