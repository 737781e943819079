"""A process's resident memory on Linux, for the benches' per-rank peaks.

``reset_peak()`` writes 5 to ``/proc/self/clear_refs``, which resets the kernel's high-water mark
of this process's resident set; ``peak_since_reset()`` then reads it (``ru_maxrss``): the peak of
whatever ran in between, not of what came before. ``rss_now()`` is the current resident set.

Whole processes: ``python bench/rss.py --peak PREFIX script.py ARGS...`` runs the script as
``__main__`` and at its exit writes the process's peak resident set (``ru_maxrss``: start-up
included) and CPU seconds to ``PREFIX.RANK`` (``RANK`` from the environment, torchrun's);
:func:`torchrun_peaks` launches a script that way on ``nproc`` ranks and reads every rank's.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import subprocess
import sys


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_since_reset() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run_with_peak(prefix: str, argv: list[str]) -> int:
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (e.code is not None)
    use = resource.getrusage(resource.RUSAGE_SELF)
    with open(f"{prefix}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({"peak": use.ru_maxrss * 1024, "cpu": use.ru_utime + use.ru_stime}, f)
    return rc


def torchrun_peaks(script: str, argv: list[str], nproc: int, prefix: str, cwd: str, env: dict) -> list[dict]:
    """``script argv`` under ``torchrun --standalone --nproc-per-node nproc``: each rank's
    ``{"peak": bytes, "cpu": seconds}`` of its whole process; raises with the output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--peak", prefix, script, *argv]
    done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    out = []
    for r in range(nproc):
        with open(f"{prefix}.{r}") as f:
            out.append(json.load(f))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--peak"]:
    sys.exit(_run_with_peak(sys.argv[2], sys.argv[3:]))
