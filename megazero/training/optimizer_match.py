"""The optimizer a checkpoint was trained with against this run's (``--optimizer``): Muon keeps its
momentum where AdamW keeps ``exp_avg`` and leaves ``exp_avg_sq`` at zero, so loading one's state
into the other would train on another optimizer's moments without a word. A checkpoint without
the flag recorded was written by AdamW (megazero had no other optimizer before)."""

from __future__ import annotations

from megazero.checkpoint import CheckpointError
from megazero.checkpoint.files import read_metadata


def check_optimizer_matches(root: str, iteration: int, flags: dict) -> None:
    """Raise one line when the saved ``optimizer`` differs from ``flags['optimizer']``."""
    saved = read_metadata(root, iteration).get("args", {}).get("optimizer", "adam")
    current = flags.get("optimizer", "adam")
    if saved != current:
        raise CheckpointError(f"--load {root}: the checkpoint's optimizer state is {saved}'s and this run trains with "
                              f"--optimizer {current}; give --optimizer {saved}, or --no-load-optim (with --finetune) "
                              "to load the weights only")
