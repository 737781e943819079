"""How a failed run reports itself: one line naming the file and the cause, the traceback only
when asked for (``--debug`` or ``MEGAZERO_DEBUG=1``), as Megatron-LM's launchers print it.

The cause of a failed write or read is its ``errno``: ``ENOSPC`` reads ``no space left on
device``, ``EFBIG`` ``file too large`` (a file-size limit: ``ulimit -f``, a quota), ``EACCES``
``permission denied``... Libraries that wrap the ``OSError`` (``torch.save``'s zip writer raises a
``RuntimeError`` whose ``__context__`` is the ``OSError`` of the Python file it wrote to) keep it in
the exception chain, which :func:`os_error_of` walks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
import warnings

HINTS = {errno.ENOSPC: "free some space, or write elsewhere",
         errno.EDQUOT: "the disk quota is used up",
         errno.EFBIG: "a file-size limit (ulimit -f) or the file system's largest file",
         errno.EROFS: "the file system is mounted read-only"}


def debug_requested(flag: bool = False, env=os.environ) -> bool:
    """``--debug`` given, or ``MEGAZERO_DEBUG`` set to anything but ``""`` / ``0``."""
    return bool(flag) or env.get("MEGAZERO_DEBUG", "") not in ("", "0")


def os_error_of(e: BaseException) -> OSError | None:
    """The first ``OSError`` with an ``errno`` in ``e``'s chain (``e``, its cause, its context...)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def describe_os_error(e: OSError, default_file: str | None = None) -> str:
    """``FILE: no space left on device (ENOSPC: hint)``; ``default_file`` names the file when the
    error does not (a ``write`` on an open file), else it is left out."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    cause = (e.strerror or os.strerror(e.errno)).lower()
    hint = HINTS.get(e.errno)
    files = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None) or default_file
    return f"{files + ': ' if files else ''}{cause} ({name}{': ' + hint if hint else ''})"


def where(e: BaseException) -> str:
    """``file.py:123``: the innermost frame of ``e``'s traceback, or ``""``."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def describe(e: BaseException, default_file: str | None = None) -> str:
    """One line for any failure: an ``OSError`` in the chain names its file and cause (with the
    wrapping message when that says more, e.g. which checkpoint), anything else its type,
    message and the line that raised it."""
    os_error = os_error_of(e)
    if os_error is not None:
        text = describe_os_error(os_error, default_file)
        return text if os_error is e else f"{text}; {type(e).__name__}: {e}"
    at = where(e)
    return f"{type(e).__name__}: {e}{' (at ' + at + ')' if at else ''}"


def report(e: BaseException, prefix: str, debug: bool, file=None) -> None:
    """Print ``prefix: <one line>``, and the traceback under ``debug``; a hint how to get it otherwise."""
    file = file or sys.stderr
    line = f"{prefix}: {describe(e)}"
    if debug:
        print(f"{line}\n{''.join(traceback.format_exception(e))}", file=file, flush=True)
    else:
        print(f"{line} [--debug or MEGAZERO_DEBUG=1 for the traceback]", file=file, flush=True)


@contextlib.contextmanager
def warnings_as_lines(rank: int, file=None):
    """Within the block, Python warnings are collected; at its normal end each distinct text is
    printed once as ``WARNING: text`` -- Megatron's form, without Python's
    category and source line -- by global rank 0 only (``rank``: the launcher's, before any process
    group), so a job of N ranks prints each warning once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield  # an error leaving the block (an invalid flag: exit 2) is the job's one message: no warnings
    for text in dict.fromkeys(str(w.message) for w in caught) if rank == 0 else ():
        print(f"WARNING: {text}", file=file or sys.stderr, flush=True)
