"""What the rerun state machine (:mod:`.rerun`) prints: who was flagged, and ``--rerun-mode
report_stats``' variability statistics in Megatron-LM's words (``QuickStats`` and
``_maybe_report_stats`` of megatron/core/rerun_state_machine.py, core_v0.19.0, commit 5be9626)."""

from __future__ import annotations

import torch.distributed as dist

from megazero.training.result_checks import KINDS

SHORT = {"nan_loss": "NaN loss", "inf_loss": "Inf loss", "spiky_loss": "spiky loss", "nan_grad": "NaN gradient",
         "inf_grad": "Inf gradient", "large_grads": "large gradient"}


def who(counts, rank_sums) -> str:
    """``rank 3: NaN gradient`` (or ``2 ranks: NaN loss``) for each kind flagged, from the packed
    sums: per kind the number of ranks whose first failure it was and the sum of their ``rank + 1``."""
    parts = []
    for kind, n, s in zip(KINDS, counts, rank_sums):
        if n > 0:
            ranks = f"rank {int(round(s)) - 1}" if round(n) == 1 else f"{int(round(n))} ranks"
            parts.append(f"{ranks}: {SHORT[kind]}")
    return ", ".join(parts)


class QuickStats:
    """The distribution of one validation call's relative differences between runs (Megatron's
    ``QuickStats``: at most ``max_size`` non-zero samples kept, zeros counted)."""

    def __init__(self, max_size: int = 100000):
        self.samples: list[float] = []
        self.zero_cnt, self.max, self.max_size, self.pos = 0, 0.0, max_size, 0

    def record(self, value: float) -> None:
        if value == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(value)
        else:
            self.samples[self.pos % self.max_size] = value
        self.pos += 1
        self.max = max(self.max, value)

    def combine(self, others: list) -> None:
        """Add the samples of other ranks' stats (kept only while they all fit, as Megatron)."""
        if not others:
            return
        n = len(self.samples) + sum(len(o.samples) for o in others)
        if n <= self.max_size:
            for o in others:
                self.samples.extend(o.samples)
            self.pos = n
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max(self.max, max(o.max for o in others))

    def reset(self) -> None:
        self.samples, self.zero_cnt, self.max, self.pos = [], 0, 0.0, 0

    def print_stats(self) -> str:
        """Megatron's line: totals, mean relative variability, percentiles and the maximum."""
        self.samples.sort()
        z, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{z:,} samples, all identical"
        t = z + n
        ps = {p: (f"{self.samples[int(t * p) - z]:.3E}" if int(t * p) - z >= 0 else "0.0")
              for p in (0.5, 0.9, 0.99, 0.999)}
        return (f"{t:,}/{z:,} total/identical samples, rel. variability: avg= {sum(self.samples) / t:.3E}, "
                f"p50= {ps[0.5]}, p90= {ps[0.9]}, p99= {ps[0.99]}, p99.9= {ps[0.999]}, max: {self.max:.3E}")


def report_stats(stats: dict, rank: int) -> None:
    """Collective: every rank's stats gathered on rank 0, which prints them per validation call
    (and keeps the combination); the others start afresh (Megatron's ``_maybe_report_stats``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(dict(stats), gathered, dst=0)
    else:
        gathered = [dict(stats)]
    if rank != 0:
        for s in stats.values():
            s.reset()
        return
    print("Stats on computation determinism in validation calls", flush=True)
    for caller in sorted({c for s in gathered for c in s}):
        mine = stats.setdefault(caller, QuickStats())
        mine.combine([s[caller] for s in gathered[1:] if caller in s])
        print(f"  From validation call '{caller}':\n    {mine.print_stats()}", flush=True)
