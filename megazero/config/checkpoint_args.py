"""``--use-checkpoint-args``: the model flags from the ``--load`` checkpoint, the rest from the
command line, as Megatron-LM's ``parse_and_validate_args`` does (megatron/training/arguments.py,
core_v0.16.0: ``load_args_from_checkpoint`` runs after parsing and before validation, so the
required-flag checks see the checkpoint's values; an omitted ``--num-layers`` is no error).

Which arguments, and when the command line wins: :mod:`megazero.model.saved_args`. The arguments
package may not import the checkpoint package, so the two file names of the format that this
reads (the pointer and ``iter_NNNNNNN/metadata.json``, ``megazero.checkpoint.schema``) are
repeated here; a test holds them equal. The metadata is validated fully when the load runs.

A Megatron-LM torch_dist folder keeps its ``args`` in ``common.pt`` (a pickle, read under
``megazero/checkpoint/`` only): the caller passes ``read_saved(load)``
(:func:`megazero.checkpoint.torch_dist.saved_args`; ``pretrain_gpt.py`` does), which gives the
model arguments of Megatron's saved ``args`` under megazero's recorded names.
"""

from __future__ import annotations

import json
import os

from megazero.model.saved_args import checkpoint_model_args

POINTER = "latest_checkpointed_iteration.txt"
METADATA = "iter_{:07d}/metadata.json"


def latest_args(load: str, read_saved=None) -> tuple[dict | None, str | None]:
    """(the saved arguments of the latest checkpoint under ``load``, None) or (None, a problem);
    ``read_saved``: the reader of a Megatron-LM torch_dist folder's arguments (module doc)."""
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
        if read_saved is None:
            return None, (f"--use-checkpoint-args: {path} is a Megatron-LM {record['sharded_backend']} checkpoint, "
                          "whose arguments pretrain_gpt.py reads (parse_args(..., read_saved=...))")
        try:
            saved = read_saved(load)
        except RuntimeError as e:  # CheckpointError: one line naming the file
            return None, f"--use-checkpoint-args: {e}"
    if not isinstance(saved, dict) or not saved:
        return None, f"--use-checkpoint-args: the checkpoint under --load {load} recorded no arguments"
    return saved, None


def apply_checkpoint_args(args, problem, read_saved=None) -> None:
    """Replace the model flags of ``args`` by the checkpoint's (:func:`checkpoint_model_args`);
    ``problem(text)`` is told when there is no ``--load`` or nothing to read there
    (``read_saved``: :func:`latest_args`)."""
    if not args.use_checkpoint_args:
        return
    if not args.load:
        problem("--use-checkpoint-args needs --load (the checkpoint whose arguments to use)")
        return
    saved, why = latest_args(args.load, read_saved)
    if why:
        problem(why)
        return
    for key, value in checkpoint_model_args(saved, vars(args)).items():
        setattr(args, key, value)
