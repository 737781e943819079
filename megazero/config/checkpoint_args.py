"""``--use-checkpoint-args``: the model flags from the ``--load`` checkpoint, the rest from the
command line, as Megatron-LM's ``parse_and_validate_args`` does (megatron/training/arguments.py,
core_v0.16.0: ``load_args_from_checkpoint`` runs after parsing and before validation, so the
required-flag checks see the checkpoint's values; an omitted ``--num-layers`` is no error).

Which arguments, and when the command line wins: :mod:`megazero.model.saved_args`. The arguments
package may not import the checkpoint package, so the two file names of the format that this
reads (the pointer and ``iter_NNNNNNN/metadata.json``, ``megazero.checkpoint.schema``) are
repeated here; a test holds them equal. The metadata is validated fully when the load runs.
"""

from __future__ import annotations

import json
import os

from megazero.model.saved_args import checkpoint_model_args

POINTER = "latest_checkpointed_iteration.txt"
METADATA = "iter_{:07d}/metadata.json"


def latest_args(load: str) -> tuple[dict | None, str | None]:
    """(the saved arguments of the latest checkpoint under ``load``, None) or (None, a problem)."""
    pointer = os.path.join(load, POINTER)
    if not os.path.exists(pointer):
        return None, f"--use-checkpoint-args: no checkpoint under --load {load} ({POINTER} is missing)"
    try:
        iteration = int(open(pointer).read().strip())
        path = os.path.join(load, METADATA.format(iteration))
        with open(path) as f:
            record = json.load(f)
        saved = record.get("args")
    except (OSError, ValueError, AttributeError) as e:
        return None, f"--use-checkpoint-args: cannot read the saved arguments under --load {load} ({e})"
    if "sharded_backend" in record:  # Megatron-LM's torch_dist record (its args are in common.pt)
        return None, (f"--use-checkpoint-args: {path} is a Megatron-LM {record['sharded_backend']} checkpoint; "
                      f"convert it once with `python tools/convert_checkpoint.py from-megatron --load {load} "
                      "--save NEW_DIR`, then --load NEW_DIR --use-checkpoint-args")
    if not isinstance(saved, dict) or not saved:
        return None, f"--use-checkpoint-args: the checkpoint under --load {load} recorded no arguments"
    return saved, None


def apply_checkpoint_args(args, problem) -> None:
    """Replace the model flags of ``args`` by the checkpoint's (:func:`checkpoint_model_args`);
    ``problem(text)`` is told when there is no ``--load`` or nothing to read there."""
    if not args.use_checkpoint_args:
        return
    if not args.load:
        problem("--use-checkpoint-args needs --load (the checkpoint whose arguments to use)")
        return
    saved, why = latest_args(args.load)
    if why:
        problem(why)
        return
    for key, value in checkpoint_model_args(saved, vars(args)).items():
        setattr(args, key, value)
