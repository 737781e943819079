"""Shared flags of the fault tests (a tiny GPT on mock data, gloo, fast logs) and the two ways
they fill a disk without touching the machine's: a file-size limit (``RLIMIT_FSIZE``: writes past
it fail with ``EFBIG``) and, where the test runs as root, a tiny ``tmpfs`` mounted in a private
mount namespace of the child only (``unshare -m``: writes past it fail with ``ENOSPC``)."""

import os
import shutil
import subprocess
import sys

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "7"]
MOCK = ["--mock-data", "--vocab-size", "100"]


def with_file_size_limit(limit_bytes: int, script: str) -> list[str]:
    """``python -c ... script``: runs ``script`` as ``__main__`` with writes limited to ``limit_bytes``
    per file (SIGXFSZ ignored, so the write fails with EFBIG instead of killing the process)."""
    return [sys.executable, "-c", "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes})); sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')", script]


def on_tiny_disk(mount: str, copy_to: str, size_kib: int, cmd: list[str]) -> list[str] | None:
    """``cmd`` run with a ``size_kib`` KiB tmpfs mounted at ``mount`` (private to it), what it left
    there copied to ``copy_to`` afterwards; None where mount namespaces are not allowed (not root)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        return None
    script = (f'm=$1; out=$2; shift 2; mount -t tmpfs -o size={size_kib}k tmpfs "$m" || exit 99; "$@"; rc=$?; '
              'cp -a "$m"/. "$out"/; exit $rc')
    return ["unshare", "-m", "sh", "-c", script, "sh", mount, copy_to, *cmd]
