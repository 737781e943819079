"""Micro-benchmark of the collectives ZeRO can use on gloo (issue 33): which primitive implements
a reduce-scatter and an all-gather fastest, measured, not assumed.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/gloo_primitives.py [--ranks 4] [--elems 4194304] [--reps 7]

Per primitive, on the same fp32 buffer of ``--elems`` elements (L): ``all_reduce`` (L, in place),
``reduce_scatter_tensor`` (L -> L/N), list ``reduce_scatter``, ``all_reduce`` + slice, a ring
reduce-scatter of N-1 ``isend``/``irecv`` steps of L/N each (``ring_rs``), ``all_gather_into_tensor``
and list ``all_gather`` (L/N -> L). Median wall ms of the slowest rank over ``--reps`` after one
warm-up. One JSON line per primitive.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from megazero.testing import run_distributed


def ring_reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` <- this rank's chunk of the sum of ``inp`` over the world: at step k rank r sends
    its running sum of chunk (r - k - 1) mod N to r + 1 and adds what it receives from r - 1 into
    chunk (r - k - 2) mod N; after N - 1 steps chunk r holds the full sum (volume L (N-1)/N)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(inp.chunk(n))
    acc = [c.clone() for c in chunks]
    buf = torch.empty_like(chunks[0])
    for k in range(n - 1):
        send_i, recv_i = (r - k - 1) % n, (r - k - 2) % n
        ops = [dist.P2POp(dist.isend, acc[send_i], (r + 1) % n), dist.P2POp(dist.irecv, buf, (r - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        acc[recv_i].add_(buf)
    out.copy_(acc[r])


def _bench(rank, world, a):
    L = a.elems
    full, shard = torch.randn(L), torch.randn(L // world)
    out_full, out_shard = torch.empty(L), torch.empty(L // world)
    cases = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out_shard, full),
        "reduce_scatter_list": lambda: dist.reduce_scatter(out_shard, list(full.chunk(world))),
        "all_reduce+slice": lambda: (dist.all_reduce(full), out_shard.copy_(full[rank * (L // world):][:L // world])),
        "ring_rs": lambda: ring_reduce_scatter(out_shard, full),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out_full, shard),
        "all_gather_list": lambda: dist.all_gather(list(out_full.chunk(world)), shard),
    }
    lines = []
    for name, fn in cases.items():
        times = []
        for i in range(a.reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                times.append(t.item() * 1000)
        lines.append({"primitive": name, "elems": L, "ranks": world, "median_ms": round(statistics.median(times), 2),
                      "min_ms": round(min(times), 2)})
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--elems", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for line in run_distributed(_bench, a.ranks, a, timeout_s=1200, collective_timeout_s=600)[0]:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
