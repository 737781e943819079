"""The global batch size as a function of consumed samples: constant, a step schedule, or a ramp-up.

``B(c)`` is the global batch size of the iteration that starts after ``c`` consumed samples; that
iteration runs ``M(c) = B(c) / (micro_batch * DP)`` micro-batches and adds ``B(c)`` to ``c``
(a skipped fp16 step too), and its applied optimizer step advances the LR schedule by ``B(c)``
(Megatron-LM ``train_step``: ``increment = get_num_microbatches() * micro_batch * DP``). ``B`` is
a pure function of ``c``, and ``c`` is saved in every checkpoint, so a run resumed anywhere sees
the same batch sizes as an uninterrupted one.

* **constant** (``--global-batch-size B``): ``B(c) = B``.
* **step** (``--step-batch-size-schedule "T0:B0 T1:B1 ..."``, Megatron-LM core_v0.19.0
  ``megatron/core/num_microbatches_calculator.py`` ``StepBatchsizeNumMicroBatchesCalculator``):
  thresholds are tokens (K/M/B/T suffixes) turned into samples ``t_i = T_i // seq_length``;
  ``B(c) = B_i`` for the last ``i`` with ``t_i <= c`` (``t_0 = 0``).
* **ramp-up** (``--rampup-batch-size S I R`` with final size ``G = --global-batch-size``,
  Megatron-LM core_v0.17.1 (commit 266f1c97) ``RampupBatchsizeNumMicroBatchesCalculator``, the last
  release that has it; core_v0.18.0 and later ignore the flag): ``n = (G - S) / I`` increments,
  ``r = R / n`` samples each (a float, as Megatron)::

      B(c) = G                        if c > R
      B(c) = S + int(c / r) * I       otherwise

Iterations of a ``--train-samples`` run (Megatron's ``update_train_iters``): constant
``T // B``; step schedule (core_v0.19.0) the number of iterations until ``c >= T``; ramp-up
(core_v0.17.1) the iterations while ``c <= R`` and ``c <= T``, then ``(T - c) // G`` more (a
partial last batch is dropped).
"""

from __future__ import annotations

import math

RAMPUP_VERSION = "core_v0.17.1"  # the last Megatron-LM release whose calculator ramps the batch size up
_SCALE = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _number(text: str) -> int:
    """``"2.4B"`` -> 2400000000 (Megatron's ``_parse_numeric_value``: K/M/B/T suffixes)."""
    text = text.strip().upper()
    mult = _SCALE.get(text[-1:], 1)
    value = float(text[:-1] if mult > 1 else text) * mult  # ValueError on words: the caller names the flag
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return int(value)


def parse_batch_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2.4e9 // seq_length, 320)]`` sorted by threshold (Megatron's
    ``_parse_schedule`` and ``_validate_schedule``); ValueError says what is wrong."""
    schedule = []
    for entry in text.strip().strip("'\"").replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = (_number(x) for x in entry.split(":", 1))
        schedule.append((threshold // seq_length if seq_length else threshold, batch))
    schedule.sort(key=lambda e: e[0])
    if not schedule or schedule[0][0] != 0:
        raise ValueError("the first entry must have threshold 0")
    if any(b[0] <= a[0] for a, b in zip(schedule, schedule[1:])) or any(bs <= 0 for _, bs in schedule):
        raise ValueError("thresholds must increase strictly and batch sizes be positive")
    return schedule


class BatchSchedule:
    """``B(c)`` and ``M(c)`` of the module docstring. Build with :meth:`from_args`; ``flag`` names
    what set the sizes (for error messages)."""

    def __init__(self, *, micro_batch_size: int, data_parallel_size: int, global_batch_size: int,
                 steps: list[tuple[int, int]] | None = None, rampup: tuple[int, int, int] | None = None,
                 flag: str = "--global-batch-size"):
        self.micro_batch_size, self.dp, self.final = micro_batch_size, data_parallel_size, global_batch_size
        self.steps, self.rampup, self.flag = steps, rampup, flag
        if rampup is not None:
            start, incr, samples = rampup
            if start < 1 or incr < 1 or samples < 1:
                raise ValueError(f"{flag} {start} {incr} {samples}: start, increment and samples must be >= 1")
            if global_batch_size < start or (global_batch_size - start) % incr:
                raise ValueError(f"{flag} {start} {incr} {samples}: --global-batch-size {global_batch_size} - start "
                                 f"{start} must be a non-negative multiple of the increment {incr}")
            increments = (global_batch_size - start) // incr
            self.samples_per_increment = samples / increments if increments else None

    @classmethod
    def from_args(cls, args, data_parallel_size: int | None = None) -> "BatchSchedule":
        """From ``--global-batch-size``, ``--step-batch-size-schedule`` (tokens, ``--seq-length``) or
        ``--rampup-batch-size`` (final size ``--global-batch-size``); ``data_parallel_size``
        defaults to ``args.data_parallel_size`` (set by validation)."""
        dp = args.data_parallel_size if data_parallel_size is None else data_parallel_size
        common = dict(micro_batch_size=args.micro_batch_size, data_parallel_size=dp)
        if getattr(args, "step_batch_size_schedule", None):
            steps = parse_batch_schedule(args.step_batch_size_schedule, args.seq_length)
            return cls(**common, global_batch_size=steps[-1][1], steps=steps, flag="--step-batch-size-schedule")
        gbs = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
        if getattr(args, "rampup_batch_size", None):
            rampup = tuple(int(v) for v in args.rampup_batch_size)
            return cls(**common, global_batch_size=gbs, rampup=rampup, flag="--rampup-batch-size")
        return cls(**common, global_batch_size=gbs)

    # ---- the sizes ---------------------------------------------------------------------------
    def global_batch_size(self, consumed_samples: int) -> int:
        """``B(c)``: the global batch size of the iteration that starts after ``consumed_samples``."""
        c = consumed_samples
        if self.steps is not None:
            return [b for t, b in self.steps if t <= c][-1]
        if self.rampup is None or self.samples_per_increment is None or c > self.rampup[2]:
            return self.final
        start, incr, _ = self.rampup
        return min(self.final, start + int(c / self.samples_per_increment) * incr)

    def num_micro_batches(self, consumed_samples: int) -> int:
        """``M(c) = B(c) / (micro_batch * DP)`` (divisibility checked by :meth:`check`)."""
        return self.global_batch_size(consumed_samples) // (self.micro_batch_size * self.dp)

    @property
    def varies(self) -> bool:
        """Whether the schedule has more than one size at all (a run may see only one of them)."""
        return (self.steps is not None and len({b for _, b in self.steps}) > 1) or (
            self.rampup is not None and self.samples_per_increment is not None)

    def _next_change(self, c: int) -> int | None:
        """The smallest consumed count > ``c`` at which ``B`` may differ from ``B(c)`` (None: never)."""
        if self.steps is not None:
            return next((t for t, _ in self.steps if t > c), None)
        if self.rampup is None or self.samples_per_increment is None or c > self.rampup[2]:
            return None
        return c + 1  # inside the ramp: step by step (B(c) uses float division, as Megatron)

    def stretches(self, iterations: int, consumed_samples: int = 0):
        """``(first consumed count, batch size, iterations)`` for each run of equal sizes over the
        next ``iterations`` iterations from ``consumed_samples``."""
        c, left, run = consumed_samples, iterations, None
        while left > 0:
            b, nxt = self.global_batch_size(c), self._next_change(c)
            n = left if nxt is None else min(left, -(-(nxt - c) // b))
            if run is not None and run[1] != b:
                yield run
                run = None
            run = (c, b, n) if run is None else (run[0], b, run[2] + n)
            c, left = c + n * b, left - n
        if run is not None:
            yield run

    def consumed_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Samples consumed after ``iterations`` more iterations from ``consumed_samples``."""
        return consumed_samples + sum(b * n for _, b, n in self.stretches(iterations, consumed_samples))

    def train_iters(self, train_samples: int) -> int:
        """Megatron's ``update_train_iters`` for ``--train-samples`` (module docstring)."""
        if self.steps is None and (self.rampup is None or self.samples_per_increment is None):
            return train_samples // self.final
        if self.steps is not None:  # core_v0.19.0: iterate while consumed < train_samples
            iters, c = 0, 0
            while c < train_samples:
                b, nxt = self.global_batch_size(c), self._next_change(c)
                stop = train_samples if nxt is None else min(nxt, train_samples)
                n = -(-(stop - c) // b)
                iters, c = iters + n, c + n * b
            return iters
        iters, c = 0, 0  # core_v0.17.1: the ramp, one iteration at a time, then the constant phase
        while c <= self.rampup[2] and c <= train_samples:
            c += self.global_batch_size(c)
            iters += 1
        return iters + max(0, train_samples - c) // self.final

    # ---- validation --------------------------------------------------------------------------
    def check(self, iterations: int, pipeline_parallel: int = 1, interleaved: bool = False) -> None:
        """Every size the first ``iterations`` iterations see divides by ``micro_batch * DP`` (and
        with interleaving gives a multiple of PP micro-batches); ValueError naming the flag."""
        unit = self.micro_batch_size * self.dp
        for c, b, _ in self.stretches(iterations):
            if b % unit:
                raise ValueError(f"{self.flag} gives a global batch size of {b} at sample {c}, not divisible by "
                                 f"--micro-batch-size {self.micro_batch_size} x data-parallel size {self.dp} = {unit}")
            if interleaved and (b // unit) % pipeline_parallel:
                raise ValueError(f"{self.flag} gives a global batch size of {b} at sample {c}: {b // unit} "
                                 "micro-batches, with interleaving not a multiple of --pipeline-model-parallel-size "
                                 f"{pipeline_parallel}")

    def describe(self) -> str:
        """One start-up line (rank 0) saying how the batch size evolves and whose semantics."""
        if self.rampup is not None:
            start, incr, samples = self.rampup
            return (f"> batch-size ramp-up honoured as in Megatron-LM {RAMPUP_VERSION} "
                    f"(RampupBatchsizeNumMicroBatchesCalculator; core_v0.18.0 and later ignore --rampup-batch-size): "
                    f"{start} to {self.final} in steps of {incr} over {samples} samples")
        if self.steps is not None:
            return ("> step batch-size schedule (samples -> global batch size, Megatron-LM core_v0.19.0): "
                    + ", ".join(f"{t} -> {b}" for t, b in self.steps))
        return f"> constant global batch size {self.final}"
