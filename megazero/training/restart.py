"""What a resumed run says about the run it continues: which launch attempt it is, the checkpoint
iteration it resumed from, and the iterations it trains again.

A run killed mid-interval (a rank SIGKILLed, a node lost) restarts under ``torchrun
--max-restarts N`` or a SLURM requeue and, with ``--load`` = ``--save``, loads the latest complete
checkpoint (a save cut short is never published: docs/checkpoints.md). The new attempt does not
know how far the killed one got unless that is written down, so the last rank records its
progress beside the checkpoints at every log line (:data:`PROGRESS_NAME`: the iteration, the
samples consumed, the launch attempt; one small file replaced atomically). At start-up rank 0
prints one line (:func:`resume_line`) whenever this is a restarted attempt or the record is ahead
of the checkpoint loaded:

    > restart: torchrun attempt 2 (TORCHELASTIC_RESTART_COUNT=1): resumed from --load D at iteration 3 (24 samples); the previous attempt had logged iteration 5: iterations 4-5 are redone

Work done after the killed attempt's last log line is not recorded: with ``--log-interval L`` up to
L - 1 more iterations are redone than the line says.
"""

from __future__ import annotations

import json
import os
import time

from megazero.parallel.launch import attempt_prefix, restart_counts

PROGRESS_NAME = "megazero.progress.json"


def write_progress(save: str, iteration: int, consumed_samples: int, env=os.environ) -> None:
    """Record in ``save`` that this attempt has logged ``iteration`` (written to a temporary
    file, then renamed over the record: a reader sees the old record or the new one, whole).
    Raises ``OSError`` when the folder cannot be written."""
    record = {"iteration": iteration, "consumed_samples": consumed_samples, "attempt": attempt_prefix(env),
              "time": round(time.time(), 3)}
    path = os.path.join(save, PROGRESS_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_progress(folder: str | None) -> dict | None:
    """The progress record in ``folder`` (:func:`write_progress`), or None when there is none or
    it cannot be read (it only informs the start-up line)."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, PROGRESS_NAME)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) and isinstance(record.get("iteration"), int) else None
    except (OSError, ValueError):
        return None


def attempt_words(env=os.environ) -> str | None:
    """``torchrun attempt 2 (TORCHELASTIC_RESTART_COUNT=1)`` and/or ``SLURM requeue 1
    (SLURM_RESTART_COUNT=1)``; None in a first attempt."""
    requeues, restarts = restart_counts(env)
    words = []
    if requeues:
        words.append(f"SLURM requeue {requeues} (SLURM_RESTART_COUNT={requeues})")
    if restarts:
        words.append(f"torchrun attempt {restarts + 1} (TORCHELASTIC_RESTART_COUNT={restarts})")
    return ", ".join(words) or None


def resume_line(load: str | None, iteration: int, consumed_samples: int, env=os.environ) -> str | None:
    """Rank 0's start-up line on a resumed run (module doc): ``iteration`` / ``consumed_samples``
    are where this attempt starts (the checkpoint's, or 0); None when this is a first attempt and
    no record of ``load`` is ahead of it."""
    attempt = attempt_words(env)
    previous = read_progress(load)
    done = previous["iteration"] if previous else None
    ahead = done is not None and done > iteration
    if attempt is None and not ahead:
        return None
    who = f"restart: {attempt}" if attempt else "resume"
    if not load:
        return f"> {who} without --load: training starts again from iteration 0 (pass --load = --save to resume)"
    start = (f"resumed from --load {load} at iteration {iteration} ({consumed_samples} samples)" if iteration
             else f"no checkpoint in --load {load} yet: training starts from iteration 0")
    run = "attempt" if attempt else "run"
    if done is None:
        return f"> {who}: {start}; what the previous {run} did after it is not recorded ({PROGRESS_NAME}) and is redone"
    if ahead:
        span = f"iteration {done} is" if done == iteration + 1 else f"iterations {iteration + 1}-{done} are"
        return f"> {who}: {start}; the previous {run} had logged iteration {done}: {span} redone"
    return f"> {who}: {start}; the previous {run} had logged iteration {done}: nothing logged is redone"
