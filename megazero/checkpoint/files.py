"""Crash-safe checkpoint I/O: write a checkpoint folder atomically, read the pointer, the
metadata and one rank's file. Names and keys come from :mod:`megazero.checkpoint.schema`.

Saving is crash-safe: all ranks write into ``iter_0000100.tmp/`` (each file itself via a
temporary name), meet at a barrier, and only then does rank 0 write ``metadata.json``, rename
the folder and rewrite ``latest_checkpointed_iteration.txt``. A rank killed mid-save leaves the
previous checkpoint, and the pointer to it, untouched; the stale ``.tmp`` folder is cleared by
the next save.

Reading: rank files are loaded with ``torch.load(weights_only=True)`` (tensors and plain values
only); a missing, truncated or unsafe file raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megazero.checkpoint.schema import (CheckpointError, iteration_dir, latest_file, layout_diffs, metadata_file,
                                        rank_file)


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
        _atomic_write_text(metadata_file(tmp), json.dumps(metadata, indent=1, sort_keys=True))
        if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): swap, then drop the old
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _atomic_write_text(latest_file(root), f"{iteration}\n")
    _barrier()
    return final


def latest_iteration(root: str) -> int | None:
    """The iteration named by the pointer file, or None if there is none."""
    path = latest_file(root)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def read_metadata(root: str, iteration: int) -> dict:
    path = metadata_file(iteration_dir(root, iteration))
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint folder is incomplete or was removed")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None


def check_layout(saved: dict, current: dict, path: str) -> None:
    """Refuse another layout (for checkpoints without an index, which cannot be resharded)."""
    diffs = layout_diffs(saved, current)
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
