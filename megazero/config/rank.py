"""Which rank this process is, for the lines only rank 0 prints (start-up notes, warnings).

Read before any process group exists (the flag checks run first) and after (the loop): the one
place that answers it. It creates no group and joins none.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def current_rank(env=os.environ) -> int:
    """This process's global rank: the process group's if started, else the launcher's
    (torchrun's ``RANK``, SLURM's ``SLURM_PROCID``; 0 in a single process). The one place that
    reads it before ``init_process_group`` (rank-0-only start-up lines, the checkpoint guard)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(env.get("RANK") or env.get("SLURM_PROCID") or 0)
