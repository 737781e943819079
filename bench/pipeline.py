"""Pipeline schedules on CPU/gloo: megazero's 1F1B and interleaved 1F1B (VP = 2) against
``torch.distributed.pipelining``'s Schedule1F1B and ScheduleInterleaved1F1B, same model, same
micro-batches, one run.

    PYTHONPATH=. .venv/bin/python bench/pipeline.py [--ranks 4] [--micro-batches 8] [--hidden 512]
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --bubble-table   # zero-bubble schedules, simulated
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --zero-bubble    # ... run, side by side with torch's

``--bubble-table``: no processes; every schedule of ``megazero.pipeline.SCHEDULES`` (and torch's
own plan of it) at PP = 4, 8 and M = 8, 16, 32 in megazero's simulator, bubble and peak memory
against the published figures (``bench/pipeline_bubbles.py``).

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
from megazero.parallel.topology import Topology

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


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class SleepBlock(nn.Module):
    """A layer whose forward/backward take fixed wall time off the CPU (``time.sleep``), as an
    accelerator's kernels would: isolates the schedule from core oversubscription."""

    def __init__(self, fwd_s):
        super().__init__()
        self.fwd_s = fwd_s
        self.scale = nn.Parameter(torch.full((), 0.5))

    def forward(self, x):
        time.sleep(self.fwd_s)
        return _SleepBackward.apply(x * self.scale, 2 * self.fwd_s)


class TimedChunk(nn.Module):
    def __init__(self, layer_ids, hidden, seed=0, sleep_s=0.0):
        super().__init__()
        self.blocks = nn.ModuleList()
        for n in layer_ids:
            if sleep_s:
                self.blocks.append(SleepBlock(sleep_s))
                continue
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


def make_chunks(pp, vp, rank, hidden, sleep_s=0.0):
    per = LAYERS // (pp * vp)
    return [TimedChunk(range((c * pp + rank) * per, (c * pp + rank + 1) * per), hidden, sleep_s=sleep_s)
            for c in range(vp)]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def data(m, b, s, h, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(m * b, s, h, generator=g), torch.randn(m * b, s, h, generator=g)


def _timed_step(run, chunks):
    for c in chunks:
        c.log.clear()
    dist.barrier()
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    busy = sum(c.busy() for c in chunks)
    return t.item(), busy


def _variant(topo, vp, impl, m, b, s, h, sleep_s):
    """(chunks, run_step(i, trace=None)) of one schedule implementation."""
    world, rank = topo.pp, topo.pp_rank
    chunks = make_chunks(world, vp, rank, h, sleep_s)
    last = topo.is_last_stage
    if impl == "megazero":
        def step_fn(chunk, mb, x):
            y = chunk(mb["x"] if x is None else x)
            return loss_fn(y, mb["y"]) if (last and chunk is chunks[-1]) else y

        def run_step(i, trace=None):
            x, y = data(m, b, s, h, i)
            mbs = [{"x": xi, "y": yi} for xi, yi in zip(x.chunk(m), y.chunk(m))]
            forward_backward(chunks, mbs, topo, step_fn, (b, s, h), torch.float32, trace=trace)
        return chunks, run_step
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    stages = [PipelineStage(c, ci * world + rank, world * vp, torch.device("cpu"), group=topo.pp_group)
              for ci, c in enumerate(chunks)]
    sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn) if vp == 1 else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)

    def run_step(i, trace=None):
        x, y = data(m, b, s, h, i)
        if topo.is_first_stage:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=[])
        else:
            sched.step()
    return chunks, run_step


VARIANTS = [(1, "megazero"), (1, "torch"), (2, "megazero"), (2, "torch")]


def _bench(rank, world, m, b, s, h, steps, warmup, sleep_s):
    """All four variants in one process group, round-robin step by step so that drifting load
    on a shared machine hits them alike."""
    topos = {vp: Topology(world, rank, tp=1, pp=world, vp=vp).create_groups() for vp in (1, 2)}
    variants = {key: _variant(topos[key[0]], key[0], key[1], m, b, s, h, sleep_s) for key in VARIANTS}
    times = {key: [] for key in VARIANTS}
    bubbles = {key: [] for key in VARIANTS}
    for i in range(warmup + steps):
        for key in VARIANTS:
            chunks, run_step = variants[key]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            t, busy = _timed_step(lambda: run_step(i), chunks)
            if i >= warmup:
                times[key].append(t)
                bubbles[key].append((t - busy) / busy)
    out = {}
    for key in VARIANTS:
        bub = torch.tensor([statistics.median(bubbles[key])])
        dist.all_reduce(bub)
        rep = None
        if key[1] == "megazero":  # one traced step: the trace's own bubble report
            trace = ScheduleTrace()
            variants[key][1](warmup + steps, trace)
            traces = gather_traces(trace)
            rep = bubble_report(traces) if traces is not None else None
        out[key] = (statistics.median(times[key]), bub.item() / world, rep)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sleep-ms", type=float, default=20.0, help="forward time of a sleeping layer")
    p.add_argument("--modes", default="matmul,sleep", help="matmul (real compute), sleep (compute off the CPU)")
    p.add_argument("--bubble-table", action="store_true", help="simulated bubble/memory table of every schedule")
    p.add_argument("--zero-bubble", action="store_true",
                   help="megazero's zero-bubble schedules side by side with torch's (bench/pipeline_zero_bubble.py)")
    a = p.parse_args(argv)
    if a.bubble_table:
        print_bubble_table()
        return
    if a.zero_bubble:
        _sibling("pipeline_zero_bubble").main(a)
        return
    a.modes = a.modes.split(",")
    torch.set_num_threads(1)
    pp, m = a.ranks, a.micro_batches
    print(f"PP={pp} ranks (gloo, CPU, 1 thread each), M={m}, micro-batch [{a.micro_batch_size}, {a.seq_length}, "
          f"{a.hidden}], {LAYERS} layers; median of {a.steps} steps after {a.warmup}")
    for mode, sleep_s in (("matmul", 0.0), ("sleep", a.sleep_ms / 1e3)):
        if mode not in a.modes:
            continue
        what = ("real matmul compute" if mode == "matmul" else
                f"sleep compute ({a.sleep_ms} ms fwd / {2 * a.sleep_ms} ms bwd per layer, off the CPU)")
        print(f"-- {what}")
        res = run_distributed(_bench, pp, m, a.micro_batch_size, a.seq_length, a.hidden, a.steps, a.warmup, sleep_s,
                              timeout_s=1200, collective_timeout_s=300)[0]
        report(res, pp, m)


def _sibling(name):
    """``bench/NAME.py`` as a module (loaded by path: bench/ is scripts, not a package)."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def print_bubble_table():
    """``bench/pipeline_bubbles.py``'s table."""
    mod = _sibling("pipeline_bubbles")
    print("simulated, a whole stage's F = B = W = 1 (megazero.pipeline.simulate); bubble = idle / step")
    print("\n".join(mod.markdown(mod.table())), flush=True)


def report(res, pp, m):
    rows = {}
    names = {(1, "megazero"): "megazero 1F1B", (2, "megazero"): "megazero interleaved VP=2",
             (1, "torch"): "torch Schedule1F1B", (2, "torch"): "torch ScheduleInterleaved1F1B"}
    for vp, impl in VARIANTS:
        t, bubble, rep = res[(vp, impl)]
        rows[(vp, impl)] = (t, bubble)
        theory = (pp - 1) / (vp * m)
        extra = f", trace bubble {rep['bubble_measured']:.3f}" if rep else ""
        print(f"{names[(vp, impl)]:32s} step {t * 1e3:8.1f} ms  bubble {bubble:.3f} (theory {theory:.3f}{extra})")
    for vp in (1, 2):
        print(f"step-time ratio megazero/torch VP={vp}: {rows[(vp, 'megazero')][0] / rows[(vp, 'torch')][0]:.3f} "
              f"(target <= 1.0)")
    for impl in ("megazero", "torch"):
        print(f"bubble cut by interleaving ({impl}): {rows[(1, impl)][1] / rows[(2, impl)][1]:.2f}x (theory 2.00x, "
              f"target >= 1.6x)", flush=True)

if __name__ == "__main__":
    main()
