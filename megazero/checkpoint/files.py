"""Crash-safe checkpoint I/O: write a checkpoint folder atomically, read the pointer, the
metadata and one rank's file. Names and keys come from :mod:`megazero.checkpoint.schema`.

Saving is crash-safe: all ranks write into ``iter_0000100.tmp/`` (each file itself via a
temporary name), meet at a barrier, and only then does rank 0 write ``metadata.json``, rename
the folder and rewrite ``latest_checkpointed_iteration.txt``. A rank killed mid-save leaves the
previous checkpoint, and the pointer to it, untouched; the stale ``.tmp`` folder is cleared by
the next save.

``--async-save``: the same protocol, the rank file written by the rank's long-lived writer
process from a host snapshot in shared memory (:class:`~.async_writer.AsyncWriter`, as
Megatron-LM's ``PersistentAsyncCaller``); the file's bytes are a synchronous save's. The next
save, or the end of training, finishes it first.

Reading: rank files are loaded with ``torch.load(weights_only=True)`` (tensors and plain values
only); a missing, truncated or unsafe file raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from megazero.checkpoint.async_writer import AsyncWriter, WriterDied
from megazero.checkpoint.guard import space_hint
from megazero.config.failures import describe
from megazero.checkpoint.schema import (ARGS, CONSUMED_SAMPLES, INDEX, ITERATION, LAYOUT, CheckpointError,
                                        iteration_dir, iteration_glob, latest_file, layout_diffs, metadata_file,
                                        rank_file)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def atomic_write_text(path: str, text: str) -> None:
    """``path`` holds ``text`` or its previous content, never a part: written beside it, synced,
    then renamed over it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PendingSave:
    """One checkpoint being saved: :meth:`start` opens the temporary folder (collective) and
    writes this rank's file -- or, given an :class:`~.async_writer.AsyncWriter`, snapshots the
    state into its shared buffer and hands it the write; :meth:`finish` (collective) waits for
    it, agrees with every rank that all files were written, then rank 0 writes ``metadata.json``,
    renames the folder and rewrites the pointer last. A failed write on any rank -- an exception
    in the snapshot or the writer, or the writer killed -- raises :class:`CheckpointError` on
    every rank naming it; the pointer is left on the previous checkpoint. ``state`` holds host
    tensors: written (or copied to the writer's buffer) before :meth:`start` returns."""

    def __init__(self, root: str, iteration: int, rank: int, state: dict, metadata: dict):
        self.root, self.iteration, self.rank, self.metadata = root, iteration, rank, metadata
        self.final = iteration_dir(root, iteration)
        self.tmp = self.final + ".tmp"
        self.state, self.error, self.writer, self.bytes_written = state, None, None, 0
        self.started = time.time()

    def start(self, writer: AsyncWriter | None = None) -> "PendingSave":
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.makedirs(self.tmp)
        _barrier()
        if writer is not None:
            self._submit(writer)
        else:
            self._write()
        return self

    def _write(self) -> None:
        path = rank_file(self.tmp, self.rank)
        try:
            self.error = write_file(self.state, path, self.tmp)
            self.bytes_written = 0 if self.error else os.path.getsize(path)
        finally:
            self.state = None  # the host tensors go as soon as they are written

    def _submit(self, writer: AsyncWriter) -> None:
        """Snapshot into the writer's buffer and hand it the file; a failure is kept for finish()."""
        path = rank_file(self.tmp, self.rank)
        try:
            writer.submit(path, self.state)
            self.writer = writer
        except WriterDied as e:
            self.error = str(e)
        except Exception as e:  # e.g. an unpicklable value, or no memory for the buffer
            self.error = f"{path}, taking its snapshot: {describe(e)}"
        finally:
            self.state = None

    def done(self) -> bool:
        """Whether this rank's file is written (no collective)."""
        return self.writer is None or self.writer.done()

    def finish(self) -> str:
        """Collective: wait, check every rank's write, publish; returns the checkpoint folder."""
        if self.writer is not None:
            self.error, self.bytes_written = self.writer.wait()
            self.writer = None
        agree_on_writes(self.error, self.rank, self.tmp, f"saving {self.final}",
                         f"{latest_file(self.root)} still names the previous checkpoint")
        if self.rank == 0:
            _publish(self.root, self.iteration, self.tmp, self.final, self.metadata)
        _barrier()
        return self.final


def write_file(state, path: str, folder: str, pickle_module=None) -> str | None:
    """``torch.save(state)`` (with ``pickle_module`` when given) to ``path`` through
    ``path.partial`` (a crash leaves no half file under the final name); the failure as one line naming the file and cause (and the free space of
    ``folder``), or None."""
    partial = path + ".partial"
    try:  # through a Python file: a failed write raises OSError with its errno (ENOSPC, EFBIG, ...)
        with open(partial, "wb") as fh:
            torch.save(state, fh, **({"pickle_module": pickle_module} if pickle_module is not None else {}))
        os.replace(partial, path)
        return None
    except BaseException as e:  # reported on every rank by agree_on_writes: the file and the cause
        text = describe(e, default_file=partial)
        return f"{text if partial in text else f'{path}: {text}'}{space_hint(folder)}"


def agree_on_writes(error: str | None, rank: int, tmp: str, what: str, kept: str) -> None:
    """Collective: every rank's write error; any failure raises :class:`CheckpointError` on every
    rank naming each (``what`` failed, ``kept`` says what is left as it was), after rank 0 removed
    the temporary folder ``tmp`` (the space of a full disk comes back at once)."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{what} failed ({'; '.join(failed)}); {kept}")


def replace_folder(tmp: str, final: str) -> None:
    """Publish the complete folder ``tmp`` as ``final``; an existing ``final`` (re-saving the same
    iteration or tag) is swapped out first and removed only after the new one is in place."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _publish(root: str, iteration: int, tmp: str, final: str, metadata: dict) -> None:
    """Rank 0, after every rank's file is in ``tmp``: metadata, rename, then the pointer."""
    atomic_write_text(metadata_file(tmp), json.dumps(metadata, indent=1, sort_keys=True))
    replace_folder(tmp, final)
    atomic_write_text(latest_file(root), f"{iteration}\n")
    for stale in glob.glob(iteration_glob(root, ".tmp")) + glob.glob(iteration_glob(root, ".old")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a run killed mid-save; published now, so safe


def save_checkpoint(root: str, iteration: int, rank: int, state: dict, metadata: dict) -> str:
    """Collective: every rank saves ``state``; rank 0 writes ``metadata`` and publishes the folder."""
    return PendingSave(root, iteration, rank, state, metadata).start().finish()


def latest_iteration(root: str) -> int | None:
    """The iteration named by the pointer file, or None if there is none."""
    path = latest_file(root)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        value = int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None
    if value < 0:
        raise CheckpointError(f"{path}: an iteration must be >= 0, found {value} (a hand-edited pointer? write the "
                              "iteration of a saved iter_* folder)")
    return value


def read_metadata(root: str, iteration: int) -> dict:
    path = metadata_file(iteration_dir(root, iteration))
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint folder is incomplete or was removed")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None
    if isinstance(meta, dict) and "sharded_backend" in meta:  # Megatron-LM's dist-checkpointing record
        raise CheckpointError(megatron_dist_refusal(path, root, meta["sharded_backend"]))
    problems = metadata_problems(meta, iteration)
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)} (hand-edited or from another folder? restore the "
                              "metadata.json saved with it)")
    return meta


def megatron_dist_refusal(path: str, root: str, backend) -> str:
    """The one line refusing a Megatron-LM ``torch_dist`` folder where megazero's own format is
    read (``to-fp32``, ``to-hf``, ``load_model``): ``pretrain_gpt.py --load`` reads it as it is
    (megazero.checkpoint.torch_dist); these tools read it once converted into a new folder."""
    return (f"{path}: a Megatron-LM {backend} checkpoint, not megazero's (pretrain_gpt.py --load {root} reads it "
            f"as it is); for this tool convert it once with `python tools/convert_checkpoint.py from-megatron "
            f"--load {root} --save NEW_DIR`")


def metadata_problems(meta, iteration: int) -> list[str]:
    """What makes ``meta`` unusable as the record of ``iter_<iteration>``: its type, its counters'
    types and values (the iteration = the folder's: otherwise a resume at that iteration trains
    nothing or repeats), and the types of its layout, args and index where present."""
    if not isinstance(meta, dict):
        return [f"expected a JSON object, found {type(meta).__name__}"]
    problems = []
    saved = meta.get(ITERATION)
    if type(saved) is not int:
        problems.append(f"'{ITERATION}' must be an integer, found {saved!r}")
    elif saved != iteration:
        problems.append(f"'{ITERATION}' is {saved} but the folder is {os.path.basename(iteration_dir('', iteration))}")
    consumed = meta.get(CONSUMED_SAMPLES, 0)
    if type(consumed) is not int or consumed < 0:
        problems.append(f"'{CONSUMED_SAMPLES}' must be an integer >= 0, found {consumed!r}")
    for key in (LAYOUT, ARGS):
        if not isinstance(meta.get(key, {}), dict):
            problems.append(f"'{key}' must be an object, found {type(meta.get(key)).__name__}")
    index = meta.get(INDEX)
    if index is not None and not (isinstance(index, dict) and isinstance(index.get("ranks"), list)):
        problems.append(f"'{INDEX}' must be an object with a 'ranks' list")
    return problems


def latest_saved_args(root: str) -> dict | None:
    """The arguments the latest checkpoint under ``root`` recorded (Megatron's names), or None
    when there is no checkpoint there yet."""
    iteration = latest_iteration(root)
    return None if iteration is None else read_metadata(root, iteration).get("args", {})


def check_layout(saved: dict, current: dict, path: str) -> None:
    """Refuse another layout (for checkpoints without an index, which cannot be resharded)."""
    diffs = layout_diffs(saved, current)
    if diffs:
        raise CheckpointError(f"{path} was saved with a different parallel layout: " + "; ".join(diffs)
                              + " (loading into another layout is not supported yet)")


def read_file(path: str, mmap: bool = False, who: str = "", allowed=()):
    """One checkpoint file via ``torch.load(weights_only=True)`` (``allowed``: the only extra
    globals a foreign format's pickles may name); ``mmap``: tensors are mapped, and only the bytes
    of those touched are read. A missing or unreadable file (truncated zip, bad pickle, a global
    not allowed) raises :class:`CheckpointError` naming it, in one line (``who`` first)."""
    prefix = f"{who}: " if who else ""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{prefix}{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - whatever torch raises, one line naming the file
        cause = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{prefix}{path} cannot be read ({type(e).__name__}: {cause})") from None


def load_rank_state(root: str, iteration: int, rank: int, mmap: bool = False) -> dict:
    """Rank ``rank``'s file (:func:`read_file`)."""
    return read_file(rank_file(iteration_dir(root, iteration), rank), mmap=mmap)
