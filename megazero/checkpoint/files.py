"""Checkpoints: ``DIR/iter_0000100/`` folders, written atomically, read with ``weights_only=True``.

Layout of one checkpoint::

    DIR/latest_checkpointed_iteration.txt      "100" -- written last, atomically
    DIR/iter_0000100/metadata.json             iteration, consumed samples, layout, arguments
    DIR/iter_0000100/rank_00005.pt             everything rank 5 owns: model chunks (its TP/PP
                                               slice; its DP shard under ZeRO-3), optimizer shard,
                                               loss scaler, LR scheduler, RNG states

Saving is crash-safe: all ranks write into ``iter_0000100.tmp/`` (each file itself via a
temporary name), meet at a barrier, and only then does rank 0 rename the folder and rewrite
``latest_checkpointed_iteration.txt``. A rank killed mid-save leaves the previous checkpoint,
and the pointer to it, untouched; the stale ``.tmp`` folder is cleared by the next save.

``metadata.json`` also holds ``index``: every rank's description of its file (parameter names,
TP split rules, local shapes, ZeRO regions and shards; see :mod:`megazero.checkpoint.reader`), so a
checkpoint loads into any other layout (:mod:`megazero.checkpoint.reshard`) and converts without the run.

Loading reads the pointer; in the same layout it loads this rank's file with
``torch.load(weights_only=True)`` (bit-exact resume, RNG included), otherwise it reshards.  A
missing, truncated or unsafe file is named in the error.  :func:`check_layout` remains for
checkpoints without an index.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
LAYOUT_KEYS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "data_parallel_size", "zero_stage", "params_dtype")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit this run; the message names the file."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def layout_of(args) -> dict:
    return {"world_size": args.world_size, "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
            "data_parallel_size": args.data_parallel_size, "zero_stage": args.zero_stage,
            "params_dtype": str(args.params_dtype).replace("torch.", "")}


def jsonable_args(args) -> dict:
    out = {}
    for key, value in sorted(vars(args).items()):
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, iteration: int, rank: int, state: dict, metadata: dict) -> str:
    """Collective: every rank saves ``state``; rank 0 writes ``metadata`` and publishes the folder."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    path = rank_file(tmp, rank)
    torch.save(state, path + ".partial")
    os.replace(path + ".partial", path)
    _barrier()
    if rank == 0:
        _atomic_write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata, indent=1, sort_keys=True))
        if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): swap, then drop the old
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _atomic_write_text(os.path.join(root, LATEST), f"{iteration}\n")
    _barrier()
    return final


def latest_iteration(root: str) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None if there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def read_metadata(root: str, iteration: int) -> dict:
    path = os.path.join(iteration_dir(root, iteration), "metadata.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint folder is incomplete or was removed")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None


def check_layout(saved: dict, current: dict, path: str) -> None:
    diffs = [f"{k} saved {saved.get(k)} vs now {current.get(k)}" for k in LAYOUT_KEYS if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"{path} was saved with a different parallel layout: " + "; ".join(diffs)
                              + " (loading into another layout is not supported yet)")


def load_rank_state(root: str, iteration: int, rank: int, mmap: bool = False) -> dict:
    """Rank ``rank``'s file via ``torch.load(weights_only=True)``; ``mmap``: tensors are mapped,
    and only the bytes of those touched are read."""
    path = rank_file(iteration_dir(root, iteration), rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, disallowed global
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
