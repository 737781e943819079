"""The saving step's cost with and without ``--async-save`` (issue 13): ``pretrain_gpt.py`` runs
under torchrun that save every ``--interval`` iterations, synchronous and asynchronous runs
alternating so both see the same machine::

    PYTHONPATH=. .venv/bin/python bench/save_timing.py --stage 3 --dp 2 --layers 2 --hidden 512 \\
        --heads 8 --dtype fp32 --rounds 3 --iters 25 --interval 6

The log line of iteration i is printed before its save, so a save's cost lands in iteration
i + 1: "after save" = the iteration after each save (the run's last save is waited for at exit,
after the last line), "normal" = every other iteration but the first. Ratio = median(after
save) / median(normal), per mode. With ``--async-save`` the trainer starts the writer and faults
its buffer in before the first iteration (``Trainer.prepare_async_save``), so every save costs
the rank one copy of its state into that buffer -- provided the previous write has ended: a
save asked for while the previous one is still being written waits for it (as Megatron's
``--async-save`` does), so saves closer together than the disk can absorb them cost the same
either way (``save_s`` lists how long each took, snapshot to publication). What the writer
does (``torch.save``'s records and CRC-32s, the page cache) needs a core of its own: with as
many ranks as cores (``--dp`` = the box's cores) it takes the ranks' CPU and shows up in the
iterations it overlaps. ``--threads`` leaves cores free (``OMP_NUM_THREADS``), as the ranks of
a GPU node do::

    PYTHONPATH=. .venv/bin/python bench/save_timing.py --dp 1 --threads 1 --rounds 3 --iters 37 --interval 12
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from memory import model_flags  # noqa: E402  (bench/memory.py: the same GPT flags)

_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?per iteration \(ms\): ([\d.]+)")
_WRITE = re.compile(r"saved checkpoint at iteration\s+\d+ to \S+ (?:in ([\d.]+) s|\(([\d.]+) s after it started)")


def timed_run(o, background: bool) -> tuple[dict, list]:
    """``({iteration: ms}, [seconds each save took])`` from the log of one run saving every
    ``o.interval`` iterations (synchronous: the save's own time; asynchronous: from the snapshot
    to the publication, which waits for the write)."""
    from megazero.testing import free_port
    folder = tempfile.mkdtemp(prefix="megazero_save_timing_")
    flags = model_flags(o, o.stage, o.dp, iters=o.iters) + ["--log-interval", "1", "--save", folder,
                                                             "--save-interval", str(o.interval)]
    flags += ["--async-save"] if background else []
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(o.dp),
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + flags
    try:
        env = dict(os.environ, OMP_NUM_THREADS=str(o.threads)) if o.threads else None
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in _LINE.finditer(done.stdout)}
    writes = [float(m.group(1) or m.group(2)) for m in _WRITE.finditer(done.stdout)]
    return times, writes


def save_timing(o) -> dict:
    """``o.rounds`` pairs of runs (synchronous first, then ``--async-save``); per mode the
    after-save and normal iteration times, their medians and ratio (module docstring)."""
    times, writes = {"sync": [], "async": []}, {"sync": [], "async": []}
    for _ in range(o.rounds):
        for mode in ("sync", "async"):
            run, saves = timed_run(o, background=mode == "async")
            times[mode].append(run)
            writes[mode] += saves
    after = set(range(o.interval + 1, o.iters + 1, o.interval))
    out = {}
    for mode, runs in times.items():
        saving = [t[i] for t in runs for i in sorted(after) if i in t]
        normal = [t[i] for t in runs for i in t if i != 1 and i not in after]
        out[mode] = {"after_save_ms": saving, "median_after_save_ms": statistics.median(saving),
                     "median_normal_ms": statistics.median(normal),
                     "ratio": statistics.median(saving) / statistics.median(normal),
                     "save_s": writes[mode]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--reduce-bucket-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default: torchrun's and "
                   "megazero's, cores // ranks); fewer leaves cores to the --async-save writers")
    p.add_argument("--rounds", type=int, default=3, help="pairs of runs (sync, async)")
    p.add_argument("--iters", type=int, default=25, help="iterations per run")
    p.add_argument("--interval", type=int, default=6, help="--save-interval (long enough for a write to end "
                   "before the next save: else that save waits for it, asynchronous or not)")
    o = p.parse_args(argv)
    if o.interval < 2 or o.iters <= o.interval:
        p.error("--interval must be >= 2 and below --iters (a normal iteration between saves)")
    load_before = os.getloadavg()[0]
    result = dict(save_timing(o), load_before=load_before, load_after=os.getloadavg()[0],
                  cpus=os.cpu_count(), ranks=o.dp, threads=o.threads)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
