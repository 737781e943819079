"""Per-phase breakdown of one training iteration from per-rank cProfile dumps (issue 33).

Profile (every rank writes ``OUT_<RANK>.prof``; the script runs as under ``torchrun``)::

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --nproc-per-node 4 bench/rank_phases.py profile OUT \\
        pretrain_gpt.py <flags>            # or: bench/ddp_peer.py --mode ddp|fsdp2
    PYTHONPATH=. .venv/bin/python bench/rank_phases.py report OUT_3.prof --iters 10

``report`` sums the cumulative time of each phase's functions and divides by ``--iters``: ms
per iteration on that rank (the last rank logs). megazero's phases: data (``next_batch``),
forward (with the ZeRO-1/2 parameter all-gather waits in forward pre-hooks, shown apart),
backward (autograd, gradient hooks included), gradient reduction wait (``finish_grad_sync``),
the iteration's packed agreement all-reduce (``agree`` less the gradient wait it contains),
optimizer with clipping (``apply_step``), logging. The peer's (``bench/ddp_peer.py``): forward
with the loss, backward (DDP's bucket all-reduces / FSDP2's reduce-scatters run inside it),
``clip_grad_norm_``, ``AdamW.step``, the loss all-reduce, the barrier. cProfile only times
Python-visible calls; a wait on a collective is time spent for the slowest rank, not the wire.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import runpy
import sys

MEGAZERO = {"data": r"training/data.py:\d+\(next_batch\)",
            "forward": r"model/stages.py:\d+\(gpt_forward_step\)",
            "  param all-gather wait (in forward)": r"zero/param_sync.py:\d+\(hook\)",
            "backward": r"method .run_backward",
            "grad reduction wait": r"grad_sync.py:\d+\(finish_grad_sync\)",
            "agreement all-reduce": r"training/agree.py:\d+\(agree\)",
            "optimizer + clip": r"zero/optimizer.py:\d+\(apply_step\)",
            "logging": r"training/log_step.py:\d+\(_log\)",
            "whole iteration": r"training/loop.py:\d+\(_iteration\)"}
PEER = {"forward": r"ddp_peer.py:\d+\(forward\)", "backward": r"method .run_backward",
        "clip_grad_norm_": r"clip_grad.py:\d+\(clip_grad_norm_\)", "optimizer": r"torch/optim/adam.py:\d+\(step\)",
        "loss all-reduce": r"distributed_c10d.py:\d+\(all_reduce\)", "barrier": r"distributed_c10d.py:\d+\(barrier\)"}


def cumulative(stats: pstats.Stats, pattern: str, outermost: bool = False) -> float:
    """Seconds of cumulative time of the functions matching ``pattern`` (``outermost``: only the
    one with the largest cumulative time, for a recursive name such as the peer's ``forward``)."""
    hits = [ct for (f, line, name), (_, _, _, ct, _) in stats.stats.items() if re.search(pattern, f"{f}:{line}({name})")]
    return (max(hits, default=0.0)) if outermost else sum(hits)


def report(path: str, iters: int) -> dict:
    stats = pstats.Stats(path)
    peer = any("ddp_peer.py" in f for f, _, _ in stats.stats)
    table = PEER if peer else MEGAZERO
    ms = {k: 1000 * cumulative(stats, v, outermost=peer and k == "forward") / iters for k, v in table.items()}
    if not peer:
        ms["agreement all-reduce"] -= ms["grad reduction wait"]  # agree() waits for the gradients first
    return {k: round(v, 1) for k, v in ms.items()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "profile":
        out, script = argv[1], argv[2]
        sys.argv = argv[2:]
        prof = cProfile.Profile()
        prof.enable()
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
        finally:
            prof.disable()
            prof.dump_stats(f"{out}_{os.environ.get('RANK', '0')}.prof")
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["report"])
    p.add_argument("paths", nargs="+")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    for path in a.paths:
        print(path, report(path, a.iters))


if __name__ == "__main__":
    main()
