"""What a user sees (issue 33): ``pretrain_gpt.py``'s logged iteration time against an
independent plain-PyTorch peer's whole step (``bench/ddp_peer.py``), paired rounds.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/user_loop.py --data-path PREFIX \
        [--stage 0 2 3] [--rounds 5] [--iters 10] [--layers 4 --hidden 256 --seq 128]

Each round runs, for every stage, megazero (``torchrun --nproc-per-node 4 pretrain_gpt.py`` with
the issue's flags, NullTokenizer over the ``.bin/.idx`` at ``--data-path``, ``--log-interval 1``)
and its peer (DDP for stages 0-2, per-block FSDP2 for stage 3), in alternating order (megazero
first on even rounds). megazero's figure is the median of its logged ``elapsed time per
iteration (ms)`` after iteration 3; the peer's the median step after 3 (its step includes
clipping, the optimizer, the loss all-reduce and read, and a barrier). Prints one JSON line per
run and per stage ``{"stage", "ratios": per round, "median", "min", "max"}``, with the time of day
and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
LOGGED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def megazero_cmd(a, stage: int) -> list[str]:
    return TORCHRUN + [str(a.ranks), "--master-port", str(random.randint(20000, 40000)), "pretrain_gpt.py",
                       "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                       "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
                       "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.micro_batch),
                       "--global-batch-size", str(a.global_batch), "--vocab-size", str(a.vocab),
                       "--clip-grad", "1.0", "--weight-decay", "0.01", "--attention-dropout", "0",
                       "--hidden-dropout", "0", "--log-interval", "1", "--train-iters", str(a.iters),
                       "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--data-path", a.data_path,
                       "--split", "100,0,0", "--eval-iters", "0", "--distributed-backend", "gloo",
                       "--zero-stage", str(stage)]


def peer_cmd(a, stage: int) -> list[str]:
    return TORCHRUN + [str(a.ranks), "--master-port", str(random.randint(20000, 40000)), "bench/ddp_peer.py",
                       "--mode", "fsdp2" if stage == 3 else "ddp", "--layers", str(a.layers),
                       "--hidden", str(a.hidden), "--heads", str(a.heads), "--seq", str(a.seq),
                       "--micro-batch", str(a.micro_batch), "--global-batch", str(a.global_batch),
                       "--vocab", str(a.vocab), "--iters", str(a.iters)]


def run(cmd: list[str]) -> float:
    """The run's median iteration ms after the first 3."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    logged = [float(x) for x in LOGGED.findall(out.stdout)]
    if logged:
        return statistics.median(logged[3:])
    return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("{")))["median_ms"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-path", required=True, help="prefix of a Megatron .bin/.idx (token ids < --vocab)")
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    for name, default in (("rounds", 5), ("iters", 10), ("ranks", 4), ("layers", 4), ("hidden", 256),
                          ("heads", 8), ("seq", 128), ("micro-batch", 4), ("global-batch", 16), ("vocab", 4096)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    ratios = {s: [] for s in a.stage}
    for r in range(a.rounds):
        for s in a.stage:
            systems = [("megazero", megazero_cmd(a, s)), ("peer", peer_cmd(a, s))]
            ms = {}
            for name, cmd in systems if r % 2 == 0 else systems[::-1]:
                ms[name] = run(cmd)
                print(json.dumps({"round": r, "stage": s, "system": name, "ms": ms[name],
                                  "time": time.strftime("%H:%M:%S", time.gmtime()),
                                  "load": round(os.getloadavg()[0], 2)}), flush=True)
            ratios[s].append(ms["megazero"] / ms["peer"])
    for s, rs in ratios.items():
        print(json.dumps({"stage": s, "peer": "fsdp2" if s == 3 else "ddp", "ratios": [round(x, 3) for x in rs],
                          "median": round(statistics.median(rs), 3), "min": round(min(rs), 3),
                          "max": round(max(rs), 3)}), flush=True)


if __name__ == "__main__":
    main()
