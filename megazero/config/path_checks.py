"""The files and folders a training run names, checked before any process group (``pretrain_gpt.py``).

Each check is ``check(err, args)`` like those of :mod:`megazero.config.checks`: ``err(message)``
records one problem naming the flag, the path and the cause, and the checks go on, so one
message lists every problem. Nothing is created or written here (``--save`` is created later, by
:func:`megazero.checkpoint.guard.guard_save_dir`); a folder that does not exist yet passes when
its nearest existing parent is a folder this process may create entries in.

* ``--save`` (and ``--tensorboard-dir``, ``--data-cache-path``): a folder, or creatable; writable (``os.access``, which also answers ``EROFS`` for
  a read-only file system); not on a pseudo file system (``/proc``, ``/sys``), where
  ``mkdir`` fails whoever runs it.
* ``--load``: when it exists, a folder this process can list and read (a ``--load`` that does not
  exist yet is Megatron's first run of a requeue script: a warning later, not an error).
* ``--data-path`` / ``--train-data-path`` ... : every prefix has a readable ``PREFIX.bin`` and
  ``PREFIX.idx`` (weights of a blend skipped: ``w1 p1 w2 p2``); ``--data-args-path`` is checked
  by :mod:`megazero.arguments` before it is read.
* Tokenizer files: ``--vocab-file`` / ``--merge-file`` readable files, ``--tokenizer-model`` a
  readable file (HuggingFaceTokenizer: a file or a folder); a tokenizer type's required file flag
  is named when it is missing and the run reads real data (``--tokenizer-type GPT2BPETokenizer
  needs --merge-file``).
* ``--save``'s file system has room for one checkpoint (:func:`check_free_space`, passed by
  ``pretrain_gpt.py``: it needs the model's size).
"""

from __future__ import annotations

import os
import shutil

from megazero.config.model import gpt_config
from megazero.planner.memory import total_params

PSEUDO_FILE_SYSTEMS = ("/proc", "/sys")
NEEDS = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "SentencePieceTokenizer": ("tokenizer_model",),
         "GPTSentencePieceTokenizer": ("tokenizer_model",), "Llama2Tokenizer": ("tokenizer_model",),
         "HuggingFaceTokenizer": ("tokenizer_model",)}


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _cause(path: str, mode: int) -> str | None:
    """Why ``path`` (which exists) cannot be used with ``mode`` (``os.R_OK`` ...), or None."""
    if os.access(path, mode):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only and mode & os.W_OK else "permission denied"


def readable_file_problem(name: str, path: str, folder_ok: bool = False) -> str | None:
    """``"--vocab-file X: no such file"`` and the like, or None when ``path`` can be read."""
    if not os.path.exists(path):
        return f"{name} {path}: no such file{' or folder' if folder_ok else ''}"
    if os.path.isdir(path):
        cause = None if folder_ok else "is a folder, not a file"
        cause = cause or _cause(path, os.R_OK | os.X_OK)
    else:
        cause = _cause(path, os.R_OK)
    return f"{name} {path}: {cause}" if cause else None


def writable_folder_problem(name: str, path: str) -> str | None:
    """Why ``path`` cannot be (created as) a folder this process writes into, or None."""
    real = os.path.realpath(path)
    pseudo = next((fs for fs in PSEUDO_FILE_SYSTEMS if real == fs or real.startswith(fs + "/")), None)
    if pseudo:
        return f"{name} {path}: is on the pseudo file system {pseudo}, where no file can be written"
    if os.path.exists(real) and not os.path.isdir(real):
        return f"{name} {path}: is a file, not a folder"
    parent = real
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{name} {path}: {parent} is a file, so the folder cannot be created"
    cause = _cause(parent, os.W_OK | os.X_OK)
    if cause:
        where = "" if parent == real else f" (cannot create it in {parent})"
        return f"{name} {path}: not writable: {cause}{where}"
    return None


def data_prefixes(paths) -> list[str]:
    """The prefixes of a ``--data-path`` list: ``[p]``, ``[p1 p2 ...]`` or ``[w1 p1 w2 p2 ...]``."""
    paths = list(paths or [])

    def is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if len(paths) > 1 and len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
        return paths[1::2]
    return paths


def check_checkpoint_paths(err, args) -> None:
    """The output folders (``--save``, ``--tensorboard-dir``, ``--data-cache-path``) writable or
    creatable, ``--load`` readable when it exists."""
    for dest in ("save", "tensorboard_dir", "data_cache_path"):
        problem = getattr(args, dest) and writable_folder_problem(flag(dest), getattr(args, dest))
        if problem:
            err(problem)
    if args.load and os.path.isdir(args.load):
        cause = _cause(args.load, os.R_OK | os.X_OK)
        if cause:
            err(f"--load {args.load}: {cause}")


def check_data_paths(err, args) -> None:
    """Every dataset prefix has a readable ``.idx`` and ``.bin``."""
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for prefix in data_prefixes(getattr(args, dest, None)):
            if not (os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin")):
                stem, ext = os.path.splitext(prefix)
                hint = (f" (give the prefix {stem}, without {ext})" if ext in (".bin", ".idx") and
                        os.path.exists(stem + ".idx") else "")
                err(f"{flag(dest)} {prefix}: no such dataset ({prefix}.bin and {prefix}.idx missing){hint}")
                continue
            for suffix in (".idx", ".bin"):
                problem = readable_file_problem(flag(dest), prefix + suffix)
                if problem:
                    err(problem)


def check_tokenizer_paths(err, args) -> None:
    """The tokenizer type's file flags are given, and every given tokenizer file can be read."""
    kind = args.tokenizer_type
    for dest in () if args.mock_data else NEEDS.get(kind, ()):
        if getattr(args, dest) is None:
            err(f"--tokenizer-type {kind} needs {flag(dest)}")
    for dest in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, dest)
        if path is not None:
            problem = readable_file_problem(flag(dest), path, folder_ok=kind == "HuggingFaceTokenizer")
            if problem:
                err(problem)


PATH_CHECKS = (check_checkpoint_paths, check_data_paths, check_tokenizer_paths)


def checkpoint_bytes(args) -> tuple[int, int]:
    """``(bytes, Φ)`` of one checkpoint, ``(p + 12) Φ`` bytes: the weights once in the parameter
    dtype (p = 2 with --fp16/--bf16, else 4) plus the fp32 master weights and Adam moments (12),
    whatever the layout (docs/checkpoints.md, "Written once"; measured 14.3 Φ in bf16, 16.3 Φ in
    fp32 on a 0.17M-parameter GPT, the rest being the index and RNG states); ``p Φ`` with
    ``--no-save-optim``. Φ is :func:`megazero.planner.memory.total_params` (the planner's); an unknown
    vocabulary (read from the tokenizer later) counts as 1 token: the estimate is then a lower bound."""
    phi = total_params(gpt_config(args, vocab_size=args.vocab_size or 1))
    p = 2 if args.fp16 or args.bf16 else 4
    return (p + (0 if args.no_save_optim else 12)) * phi, phi


def check_free_space(err, args) -> None:
    """``err`` when the file system of ``--save`` (or its nearest existing parent) has less free
    space than one checkpoint (:func:`checkpoint_bytes`)."""
    if not args.save:
        return
    path = os.path.realpath(args.save)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    (need, phi), free = checkpoint_bytes(args), shutil.disk_usage(path).free
    if free < need:
        err(f"--save {args.save}: no space left on device for one checkpoint: {free / 2 ** 30:.2f} GiB free on "
            f"{path}, a checkpoint needs about {need / 2 ** 30:.2f} GiB ({need // phi} bytes x {phi:,} parameters)")
