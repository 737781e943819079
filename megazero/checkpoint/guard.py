"""No checkpoint lost: what a run checks about its ``--save`` folder before any work.

* ``--save`` must be a folder that can be created and written (not a file, not under a read-only
  or pseudo file system): checked by creating the folder and a probe file in it.
* A folder already holding a checkpoint (``latest_checkpointed_iteration.txt`` or an
  ``iter_*`` folder) is only saved into by the run that loads from it (``--load`` is the same
  folder, and not with ``--finetune``, which restarts at iteration 0), or with
  ``--overwrite-checkpoints``; otherwise a new run would overwrite its iterations and move its
  pointer back.
* ``<save>/megazero.lock`` holds ``host pid time launch`` of the run saving there (written by rank 0,
  exclusively created, its time refreshed every :data:`REFRESH_S` seconds by a daemon thread). A
  second run refuses to start while the lock is live. A lock is stale, and is taken over with one
  line saying so, when its process is gone (same host, pid not alive) or it has not been refreshed
  for :data:`STALE_S` seconds (a dead host), or it was written by an earlier attempt of the same
  launch (:func:`launch_identity`: a SLURM requeue, or a ``torchrun --max-restarts`` restart whose
  rank 0 is now on another node). The same process may claim its own lock again.
* The file system of ``--save`` must have room for one checkpoint, ``(p + 12) Φ`` bytes
  (:func:`megazero.config.path_checks.checkpoint_bytes`), checked with the flags
  (``pretrain_gpt.py`` passes :func:`megazero.config.path_checks.check_free_space` to
  ``parse_args``), so a run does not train for hours to fail at its first save.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import threading
import time

from megazero.checkpoint.schema import CheckpointError, iteration_glob, latest_file

LOCK_NAME = "megazero.lock"
REFRESH_S = 30.0
STALE_S = 300.0


def check_writable(save: str) -> None:
    """Create ``save`` (and parents) and a probe file in it; raise naming the path and cause."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(f"--save {save} is a file, not a folder")
    probe = os.path.join(save, f".write-test-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(save, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {save} is not writable ({e.strerror or e}): nothing would be saved") from None


def space_hint(path: str, min_free: int = 64 << 20) -> str:
    """`` (no space left on device: N MiB free on PATH)`` when the file system of ``path`` (or its
    nearest existing parent) has under ``min_free`` bytes free, else ``""``: the words a failed
    write's own message (``basic_ios::clear: iostream error``) leaves out."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path or ".").free
    except OSError:
        return ""
    return f" (no space left on device: {free >> 20} MiB free on {path})" if free < min_free else ""


def holds_checkpoint(save: str) -> bool:
    return os.path.exists(latest_file(save)) or any(
        os.path.isdir(p) and not p.endswith((".tmp", ".old")) for p in glob.glob(iteration_glob(save)))


def checkpoint_holding(path: str) -> str | None:
    """The checkpoint folder (one holding a pointer or ``iter_*`` folders) that ``path`` is, or
    lies anywhere inside, else None."""
    here = os.path.realpath(path)
    while True:
        if os.path.isdir(here) and holds_checkpoint(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def check_output(path: str, flag: str, overwrite: bool, folder: bool) -> None:
    """A tool's output: never inside a checkpoint (a converted file written into ``--load`` can
    replace its files); an existing file, or a non-empty folder (``folder``), only with
    ``--overwrite``."""
    inside = checkpoint_holding(path)
    if inside is not None:
        where = "holds a checkpoint" if inside == os.path.realpath(path) else f"is inside the checkpoint folder {inside}"
        raise CheckpointError(f"{flag} {path} {where}: writing there could replace its files; choose a path "
                              "outside it")
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path} is a file, not a folder")
    if not folder and os.path.isdir(path):
        raise CheckpointError(f"{flag} {path} is a folder; give a file name")
    occupied = os.path.isdir(path) and bool(os.listdir(path)) if folder else os.path.exists(path)
    if occupied and not overwrite:
        raise CheckpointError(f"{flag} {path} {'is not an empty folder' if folder else 'exists'}: pass --overwrite "
                              "to replace it, or choose a new path")


def check_overwrite(save: str, load: str | None, overwrite: bool, finetune: bool = False) -> None:
    """Refuse a folder holding a checkpoint this run does not load from, or loads from with
    ``--finetune`` (which restarts at iteration 0: its first saves would replace the loaded run's
    ``iter_*`` folders and move the pointer back)."""
    if overwrite or not holds_checkpoint(save):
        return
    if load and os.path.realpath(load) == os.path.realpath(save):
        if finetune:
            raise CheckpointError(f"--finetune with --load and --save both {save}: the fine-tuning run starts at "
                                  "iteration 0 and would overwrite the checkpoint it loads (its iterations and "
                                  "pointer); give --save another folder, or pass --overwrite-checkpoints")
        return
    raise CheckpointError(f"--save {save} already holds a checkpoint that this run does not load from "
                          f"(--load {load or 'not given'}): saving would overwrite its iterations and move its "
                          "pointer; resume with --load pointing there, choose another --save, or pass "
                          "--overwrite-checkpoints")


def launch_identity(env=os.environ) -> str:
    """What every attempt of one launch shares, and no other live launch: SLURM's job id (a
    requeue keeps it), else torchrun's ``torchrun:<TORCHELASTIC_RUN_ID>@<MASTER_ADDR>:<MASTER_PORT>``
    (a restart keeps its run id and its agent's store address), else ``-``."""
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}@{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return "-"


def _job() -> str:
    return "".join(launch_identity().split()) or "-"  # one field of the lock's line


def _read_lock(path: str):
    try:
        host, pid, stamp, *job = open(path).read().split()
        return host, int(pid), float(stamp), (job or ["-"])[0]
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_state(path: str):
    """``(None, why)``: free or stale; ``(owner text, None)``: held by a live run."""
    held = _read_lock(path)
    if held is None:
        return None, None if not os.path.exists(path) else "unreadable"
    host, pid, stamp, job = held
    me = socket.gethostname()
    if host == me and pid == os.getpid():
        return None, None
    if host == me and not _pid_alive(pid):
        return None, f"process {pid} on {host} is gone"
    if job != "-" and job == _job():  # a requeued SLURM job or a restarted torchrun, maybe on another node
        launch = job if job.startswith("torchrun:") else f"SLURM job {job}"
        return None, f"an earlier attempt of {launch} (process {pid} on {host})"
    age = time.time() - max(stamp, os.path.getmtime(path))
    if age > STALE_S:
        return None, f"not refreshed for {age:.0f} s (process {pid} on {host})"
    return f"process {pid} on {host}", None


def claim_lock(save: str, print_fn=print) -> str:
    """Take ``save``'s lock for this process (see module doc); returns its path."""
    path = os.path.join(save, LOCK_NAME)
    owner, stale = lock_state(path)
    if owner is not None:
        raise CheckpointError(f"{path}: another run ({owner}) is saving into --save {save}; two runs in one folder "
                              f"overwrite each other's checkpoints (remove the lock only if that run is gone)")
    if stale:
        print_fn(f"> taking over the stale checkpoint lock {path} ({stale})")
    text = f"{socket.gethostname()} {os.getpid()} {time.time():.0f} {_job()}\n"
    if stale or os.path.exists(path):  # stale or our own: replace it
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    else:  # free: create it exclusively, so two runs starting together cannot both win
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return claim_lock(save, print_fn)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    stop = threading.Event()
    threading.Thread(target=_refresh, args=(path, text, stop), name="megazero-save-lock", daemon=True).start()
    atexit.register(release_lock, path, stop)
    return path


def _refresh(path: str, text: str, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_S):
        try:
            if open(path).read() == text:
                os.utime(path)
        except OSError:
            pass


def release_lock(path: str, stop: threading.Event | None = None) -> None:
    """Remove the lock if this process holds it."""
    if stop is not None:
        stop.set()
    held = _read_lock(path)
    if held and held[0] == socket.gethostname() and held[1] == os.getpid():
        try:
            os.remove(path)
        except OSError:
            pass


def guard_save_dir(save: str | None, load: str | None, overwrite: bool, rank: int, print_fn=print,
                   finetune: bool = False) -> None:
    """Before any work: ``--save`` writable, not another run's checkpoints (nor, with
    ``--finetune``, the one it loads), locked by rank 0."""
    if not save:
        return
    check_writable(save)
    check_overwrite(save, load, overwrite, finetune)
    if rank == 0:
        claim_lock(save, print_fn)
