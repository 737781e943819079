"""ZeRO on CPU/gloo: communication volume, model-state bytes and step time against PyTorch peers.

    PYTHONPATH=. .venv/bin/python bench/zero.py [--stage S ...] [--ranks 4] [--hidden 256]
        [--layers 8] [--micro-batches 1] [--steps 8]

Prints JSON lines:

* ``{"kind": "volume", "stage": S, "phi": Φ, "dp_logical_multiple": ..., "dp_primitive_multiple":
  ..., "primitives": {...}}`` -- measured per step per rank, from the optimizer's counters.  The
  logical multiple is the algorithm's ring-equivalent volume / Φ (ZeRO: 2, 2, 2, 3 for M = 1); the
  primitive multiple is what the primitives that ran move (on gloo a reduce-scatter runs as an
  all-reduce whose slice is kept: 2L instead of L, see megazero/zero/collectives.py).
* ``{"kind": "state", "stage": S, "bytes": ..., "formula": ..., "ratio": ...}`` -- fp16 params
  and grads, fp32 master and Adam moments, per rank, against 16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N.
* ``{"kind": "time", "system": ..., "median_s": ...}`` and ``{"kind": "ratio", ...}`` -- median
  step time (slowest rank) of ZeRO 0/1/2 vs ``DistributedDataParallel`` + ``AdamW(foreach)``, and
  ZeRO 3 vs FSDP2 ``fully_shard`` per layer; targets 1.05, 1.0 and stage3/stage2 1.25.

Model: ``--layers`` residual MLP blocks of width ``--hidden`` (4x inner), fp32, M micro-batches of
64 rows each, same weights and batches for every system.  All systems run in one launch, their
steps interleaved round-robin (each system's own model), so a shared box's load is spread evenly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megazero.testing import run_distributed
from megazero.parallel.topology import Topology


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))


class Model(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().square().mean()


def _time_once(step):
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _round_robin(systems: dict, steps: int, warmup: int) -> dict:
    """Median step time of each system, steps interleaved (A B C A B C ...) so that load from
    other processes on a shared box hits every system alike."""
    times = {name: [] for name in systems}
    for i in range(warmup + steps):
        for name, step in systems.items():
            t = _time_once(step)
            if i >= warmup:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _zero(topo, a, stage, x):
    from megazero.zero import ZeroOptimizer
    model = Model(a.hidden, a.layers)
    opt = ZeroOptimizer(model, topo, stage=stage, num_micro_batches=a.micro_batches, lr=1e-4,
                        param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=2 * a.hidden ** 2 * 8,
                        reduce_bucket_size=a.bucket)

    def step():
        for k in range(a.micro_batches):
            model(x[k]).backward(opt.loss_scale / a.micro_batches)
        opt.finish_grad_sync()
        opt.step()
    return step, opt


def _volume(opt, stage, a):
    comm = opt.last_comm
    prims = {k: v["primitive"] for k, v in comm["by_group"].items()}
    return {"kind": "volume", "stage": stage, "phi": comm["phi"], "micro_batches": a.micro_batches,
               "dp_logical_multiple": comm["dp_logical_multiple"],
               "dp_primitive_multiple": comm["dp_primitive_multiple"], "primitives": prims}


def _ddp(a, x):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(Model(a.hidden, a.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        for k in range(a.micro_batches):
            if k < a.micro_batches - 1:
                with model.no_sync():
                    (model(x[k]) / a.micro_batches).backward()
            else:
                (model(x[k]) / a.micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return step


def _fsdp2(a, x, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = Model(a.hidden, a.layers)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        for k in range(a.micro_batches):
            (model(x[k]) / a.micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return step


def _state(topo, a, stage):
    from megazero.zero import ZeroOptimizer
    model = Model(a.hidden, a.layers)
    opt = ZeroOptimizer(model, topo, stage=stage, params_dtype=torch.float16, param_persistence_threshold=0,
                        reduce_bucket_size=a.bucket)
    s = opt.state_bytes()
    opt.close()
    return {"kind": "state", "stage": stage, "phi": s["phi"], "dp": s["dp"], "bytes": s["total"],
            "formula": s["formula"], "ratio": round(s["total"] / s["formula"], 4),
            "breakdown": {k: s[k] for k in ("params", "grads", "master", "moments")}}


def _bench(rank, world, a):
    topo = Topology(world, rank).create_groups()
    g = torch.Generator().manual_seed(rank)
    x = [torch.randn(a.tokens, a.hidden, generator=g) for _ in range(a.micro_batches)]
    lines, systems, opts = [], {}, {}
    for stage in a.stage:
        lines.append(_state(topo, a, stage))
    for stage in a.stage:
        systems[f"zero-{stage}"], opts[stage] = _zero(topo, a, stage, x)
    if any(s < 3 for s in a.stage):
        systems["ddp"] = _ddp(a, x)
    if 3 in a.stage:
        systems["fsdp2"] = _fsdp2(a, x, world)
    times = _round_robin(systems, a.steps, a.warmup)
    for stage, opt in opts.items():
        lines.append(_volume(opt, stage, a))
    for name, t in times.items():
        lines.append({"kind": "time", "system": name, "median_s": round(t, 5), "ranks": world,
                      "micro_batches": a.micro_batches, "tokens": a.tokens, "hidden": a.hidden,
                      "layers": a.layers})
    for stage in a.stage:
        peer, target = ("fsdp2", 1.0) if stage == 3 else ("ddp", 1.05)
        r = times[f"zero-{stage}"] / times[peer]
        lines.append({"kind": "ratio", "what": f"zero-{stage}/{peer}", "ratio": round(r, 3), "target": target,
                      "met": r <= target})
    if 2 in a.stage and 3 in a.stage:
        r = times["zero-3"] / times["zero-2"]
        lines.append({"kind": "ratio", "what": "zero-3/zero-2", "ratio": round(r, 3), "target": 1.25, "met": r <= 1.25})
    return lines if rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens per micro-batch per rank: compute per step grows with it, communication does not")
    p.add_argument("--bucket", type=int, default=2_000_000, help="--zero-reduce-bucket-size (elements)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for line in run_distributed(_bench, a.ranks, a, timeout_s=900, collective_timeout_s=300)[0]:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
