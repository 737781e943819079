"""Cost of ``engine.save_checkpoint(dir, tag, format="deepspeed")`` (DeepSpeed 0.19.8's files)
next to the engine's own format: an MLP of ``--layers`` ``--width`` x ``--width`` linears (fp32,
AdamW) over DP ``--dp`` at ZeRO ``--stage``, one step, then ``--rounds`` saves of each format.
Per save: wall time (the slowest rank, median over rounds); the file bytes every rank wrote
(``/proc/self/io`` ``write_bytes``: file data dirtied, a scratch copy removed afterwards
included), summed over the ranks; the bytes sent through the process group's sockets
(``wchar`` minus ``write_bytes``: the exchange between ranks); the published folder's bytes::

    PYTHONPATH=. .venv/bin/python bench/engine_ds_save.py --stage 2 --dp 2 --width 1024 --layers 4
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
from megazero.testing import run_distributed  # noqa: E402


def _io() -> tuple[int, int]:
    """(``write_bytes``, ``wchar``) of this process so far."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines() if line)
    return int(fields["write_bytes"]), int(fields["wchar"])


def worker(rank, world, stage, width, layers, rounds, folder):
    import torch
    import megazero
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine = megazero.initialize(model=model, config=cfg)[0]
    engine.backward(engine(torch.randn(2, width)).square().mean())
    engine.step()
    out = {}
    for fmt in ("megazero", "deepspeed") * rounds:
        torch.distributed.barrier()
        (f0, w0), t0 = _io(), time.perf_counter()
        engine.save_checkpoint(os.path.join(folder, fmt), "t", format=fmt)
        seconds, (f1, w1) = time.perf_counter() - t0, _io()
        out.setdefault(fmt, []).append((seconds, f1 - f0, (w1 - w0) - (f1 - f0)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    folder = tempfile.mkdtemp()
    try:
        results = run_distributed(worker, a.dp, a.stage, a.width, a.layers, a.rounds, folder, timeout_s=600)
        params = a.layers * (a.width * a.width + a.width)
        print(f"MLP {a.layers} x {a.width}: {params:,} parameters, ZeRO {a.stage}, DP {a.dp}, {a.rounds} rounds")
        print("| format | save s (median, slowest rank) | file bytes written | bytes sent between ranks | folder |")
        print("|---|---|---|---|---|")
        for fmt in ("megazero", "deepspeed"):
            secs = statistics.median(max(r[fmt][i][0] for r in results) for i in range(a.rounds))
            wrote, sent = (statistics.median(sum(r[fmt][i][j] for r in results) for i in range(a.rounds)) for j in (1, 2))
            top = os.path.join(folder, fmt, "t")
            size = sum(os.path.getsize(os.path.join(top, n)) for n in os.listdir(top))
            print(f"| {fmt} | {secs:.3f} | {wrote / 2**20:.1f} MiB | {sent / 2**20:.1f} MiB | {size / 2**20:.1f} MiB |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
