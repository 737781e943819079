"""Pipeline schedules on CPU/gloo: megazero's 1F1B and interleaved 1F1B (VP = 2) against
``torch.distributed.pipelining``'s Schedule1F1B and ScheduleInterleaved1F1B, same model, same
micro-batches, one run.

    PYTHONPATH=. .venv/bin/python bench/pipeline.py [--ranks 4] [--micro-batches 8] [--hidden 512]

Model: ``PP * VP`` chunks (``8 / (PP VP)``-layer slices of 8 residual GELU-MLP layers, the
same weights everywhere), batch-first activations ``[b, s, h]``, MSE loss on the last stage.
Every chunk is wrapped in a timer (forward span; backward from the output's gradient arriving
to the input's gradient leaving), identical for both frameworks, so the measured bubble
``(T - busy) / busy`` (``T``: step time between barriers, slowest rank; ``busy``: a rank's
forward + backward time) is computed the same way for both; theory ``(PP - 1) / (VP M)``.
For megazero the schedule trace's own bubble report is printed too.

Step time: median over ``--steps`` steps after ``--warmup`` steps.  With more ranks than cores
(e.g. 4 ranks on 2 cores) ranks share cores, which inflates compute in the steady phase more
than in warm-up/cool-down; read the bubble figures with that in mind.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megazero.pipeline import ScheduleTrace, forward_backward, gather_traces, bubble_report
from megazero.testing import run_distributed
from megazero.topology import Topology

LAYERS = 8


class _Mark(torch.autograd.Function):
    """Identity whose backward records a timestamp (``dummy`` makes the first stage's input
    boundary part of the graph too)."""

    @staticmethod
    def forward(ctx, x, dummy, log, key):
        ctx.log, ctx.key = log, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.setdefault(ctx.key, []).append(time.perf_counter())
        return g, None, None, None


class TimedChunk(nn.Module):
    def __init__(self, layer_ids, hidden, seed=0):
        super().__init__()
        self.blocks = nn.ModuleList()
        for n in layer_ids:
            g = torch.Generator().manual_seed(seed * 1000 + n)
            fc1, fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
            with torch.no_grad():
                for lin in (fc1, fc2):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
                    lin.bias.zero_()
            self.blocks.append(nn.Sequential(fc1, nn.GELU(), fc2))
        self.dummy = nn.Parameter(torch.zeros(()))
        self.log: dict = {}

    def forward(self, x):
        t = time.perf_counter()
        x = _Mark.apply(x, self.dummy, self.log, "bwd_end")
        for blk in self.blocks:
            x = x + blk(x)
        x = _Mark.apply(x, self.dummy, self.log, "bwd_start")
        self.log.setdefault("fwd", []).append(time.perf_counter() - t)
        return x

    def busy(self) -> float:
        fwd = sum(self.log.get("fwd", []))
        bwd = sum(e - s for s, e in zip(self.log.get("bwd_start", []), self.log.get("bwd_end", [])))
        return fwd + bwd


def make_chunks(pp, vp, rank, hidden):
    per = LAYERS // (pp * vp)
    return [TimedChunk(range((c * pp + rank) * per, (c * pp + rank + 1) * per), hidden) for c in range(vp)]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def data(m, b, s, h, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(m * b, s, h, generator=g), torch.randn(m * b, s, h, generator=g)


def _timed_step(run, chunks, world_group_max=True):
    for c in chunks:
        c.log.clear()
    dist.barrier()
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    busy = sum(c.busy() for c in chunks)
    return t.item(), busy


def _bench(rank, world, vp, impl, m, b, s, h, steps, warmup):
    topo = Topology(world, rank, tp=1, pp=world, vp=vp).create_groups()
    chunks = make_chunks(world, vp, rank, h)
    last = topo.is_last_stage
    if impl == "megazero":
        def step_fn(chunk, mb, x):
            y = chunk(mb["x"] if x is None else x)
            return loss_fn(y, mb["y"]) if (last and chunk is chunks[-1]) else y

        def run_step(i, trace=None):
            x, y = data(m, b, s, h, i)
            mbs = [{"x": xi, "y": yi} for xi, yi in zip(x.chunk(m), y.chunk(m))]
            forward_backward(chunks, mbs, topo, step_fn, (b, s, h), torch.float32, trace=trace)
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
        stages = [PipelineStage(c, ci * world + rank, world * vp, torch.device("cpu")) for ci, c in enumerate(chunks)]
        sched = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if vp == 1
                 else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))

        def run_step(i, trace=None):
            x, y = data(m, b, s, h, i)
            if topo.is_first_stage:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()
    times, bubbles = [], []
    for i in range(warmup + steps):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        t, busy = _timed_step(lambda: run_step(i), chunks)
        if i >= warmup:
            times.append(t)
            bubbles.append((t - busy) / busy)
    bub = torch.tensor([statistics.median(bubbles)])
    dist.all_reduce(bub)
    rep = None
    if impl == "megazero":  # one traced step: the trace's own bubble report
        trace = ScheduleTrace()
        run_step(warmup + steps, trace)
        traces = gather_traces(trace)
        rep = bubble_report(traces) if traces is not None else None
    return statistics.median(times), bub.item() / world, rep


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    pp, m = a.ranks, a.micro_batches
    print(f"PP={pp} ranks (gloo, CPU, 1 thread each), M={m}, micro-batch [{a.micro_batch_size}, {a.seq_length}, "
          f"{a.hidden}], {LAYERS} layers; median of {a.steps} steps after {a.warmup}")
    rows = {}
    for vp in (1, 2):
        for impl in ("megazero", "torch"):
            res = run_distributed(_bench, pp, vp, impl, m, a.micro_batch_size, a.seq_length, a.hidden, a.steps,
                                  a.warmup, timeout_s=600)
            t, bubble, rep = res[0]
            rows[(vp, impl)] = (t, bubble)
            theory = (pp - 1) / (vp * m)
            name = {(1, "megazero"): "megazero 1F1B", (2, "megazero"): "megazero interleaved VP=2",
                    (1, "torch"): "torch Schedule1F1B", (2, "torch"): "torch ScheduleInterleaved1F1B"}[(vp, impl)]
            extra = f", trace bubble {rep['bubble_measured']:.3f}" if rep else ""
            print(f"{name:32s} step {t * 1e3:8.1f} ms  bubble {bubble:.3f} (theory {theory:.3f}{extra})", flush=True)
    for vp in (1, 2):
        print(f"step-time ratio megazero/torch VP={vp}: {rows[(vp, 'megazero')][0] / rows[(vp, 'torch')][0]:.3f} "
              f"(target <= 1.0)")
    for impl in ("megazero", "torch"):
        print(f"bubble cut by interleaving ({impl}): {rows[(1, impl)][1] / rows[(2, impl)][1]:.2f}x (theory 2.00x, "
              f"target >= 1.6x)")


if __name__ == "__main__":
    main()
