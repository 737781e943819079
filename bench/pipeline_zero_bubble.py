"""Side by side on CPU/gloo: megazero's zero-bubble schedules against ``torch.distributed.pipelining``'s
own (``bench/pipeline.py --zero-bubble``).

    PYTHONPATH=. .venv/bin/python bench/pipeline.py --zero-bubble [--ranks 4] [--micro-batches 8]

One toy model, split the same way for both: ``LAYERS`` residual GELU-MLP blocks built from
megazero's ``ColumnParallelLinear`` / ``RowParallelLinear`` (TP 1; the layers whose weight
gradient megazero defers to the plan's ``W``), ``LAYERS / (PP VP)`` blocks per virtual stage,
virtual stage ``s`` on the rank the schedule's placement says (looped, or the V for ``zbv`` /
``dualpipev``), the same weights on both sides (drawn per global block). MSE loss on the last
stage, the mean over micro-batches (torch's ``scale_grads``, megazero's ``1 / M`` seed).

Per schedule -- ``1f1b`` (torch ``Schedule1F1B``), ``zb-h1`` (``ScheduleInterleavedZeroBubble``, one
stage per rank), ``interleaved-zb`` (the same, two), ``zbv`` (``ScheduleZBVZeroBubble``),
``dualpipev`` (``ScheduleDualPipeV``) -- both frameworks run the same micro-batches, in
round-robin with every other variant of every schedule, step by step (the order rotated every
round), so drifting machine load hits them alike: the per-micro-batch losses and every parameter's gradient of the first step must agree
(max |diff| reported), then the median step time over ``--steps`` after ``--warmup``; reported:
megazero / torch per schedule (the medians' ratio, and the median of the rounds' ratios -- a
round runs both back to back or nearly), and each megazero schedule / megazero 1F1B.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megazero.parallel.layout import chunk_roles, stage_of_chunk
from megazero.parallel.topology import Topology

LAYERS = 8
CASES = [("1f1b", 1, "Schedule1F1B"), ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
         ("interleaved-zb", 2, "ScheduleInterleavedZeroBubble"), ("zbv", 2, "ScheduleZBVZeroBubble"),
         ("dualpipev", 2, "ScheduleDualPipeV")]


class Chunk(nn.Module):
    """Global blocks ``ids``: ``x + W2 gelu(W1 x + b1) + b2`` each, megazero's TP-1 linears."""

    def __init__(self, ids, hidden):
        super().__init__()
        from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        self.blocks = nn.ModuleList()
        for n in ids:
            fc1 = ColumnParallelLinear(hidden, 2 * hidden, None, device="cpu")
            fc2 = RowParallelLinear(2 * hidden, hidden, None, device="cpu")
            g = torch.Generator().manual_seed(1000 + n)
            with torch.no_grad():
                for lin in (fc1, fc2):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
                    lin.bias.copy_(0.01 * torch.randn(lin.bias.shape, generator=g))
            self.blocks.append(nn.ModuleList([fc1, fc2]))

    def forward(self, x):
        for fc1, fc2 in self.blocks:
            x = x + fc2(torch.nn.functional.gelu(fc1(x)))
        return x


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def make_chunks(pp, vp, rank, hidden, placement):
    per = LAYERS // (pp * vp)
    return [Chunk(range(s * per, (s + 1) * per), hidden)
            for s in (stage_of_chunk(pp, vp, rank, c, placement) for c in range(vp))]


def data(m, b, s, h, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(m * b, s, h, generator=g), torch.randn(m * b, s, h, generator=g)


def _megazero(topo, name, vp, m, b, s, h):
    from megazero.pipeline import PipelineRunner, placement
    from megazero.tensor_parallel.weight_grad_store import weight_grad_stores
    where = placement(name)
    chunks = make_chunks(topo.pp, vp, topo.pp_rank, h, where)
    stores = weight_grad_stores(chunks)
    last = [post for _, post in chunk_roles(topo.pp, vp, topo.pp_rank, where)]
    runner = PipelineRunner(topo, m, (b, s, h), torch.float32)

    def step_fn(chunk, mb, x):
        y = chunk(mb["x"] if x is None else x)
        return loss_fn(y, mb["y"]) if last[chunks.index(chunk)] else y

    def run(i):
        x, y = data(m, b, s, h, i)
        mbs = [{"x": xi, "y": yi} for xi, yi in zip(x.chunk(m), y.chunk(m))]
        return [float(v) for v in runner.run(chunks, mbs, step_fn, weight_grad_stores=stores)]
    return chunks, run


def _torch(topo, name, vp, cls, m, b, s, h):
    from torch.distributed.pipelining import PipelineStage, schedules
    from megazero.pipeline import placement
    where = placement(name)
    chunks = make_chunks(topo.pp, vp, topo.pp_rank, h, where)
    stages = [PipelineStage(c, stage_of_chunk(topo.pp, vp, topo.pp_rank, i, where), topo.pp * vp,
                            torch.device("cpu"), group=topo.pp_group) for i, c in enumerate(chunks)]
    sched = getattr(schedules, cls)(stages[0] if cls == "Schedule1F1B" else stages, m, loss_fn=loss_fn)
    roles = chunk_roles(topo.pp, vp, topo.pp_rank, where)
    first, last = any(pre for pre, _ in roles), any(post for _, post in roles)

    def run(i):
        x, y = data(m, b, s, h, i)
        losses: list = []
        kw = {"target": y, "losses": losses} if last else {}
        sched.step(x, **kw) if first else sched.step(**kw)
        return [float(v.detach()) for v in losses]
    return chunks, run


def _grads(chunks):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for c in chunks for p in c.parameters()]


def _timed(run, chunks, i):
    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    losses = run(i)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), losses


def bench(rank, world, m, b, s, h, steps, warmup):
    """Every case's two variants built up front and run round-robin, step by step, the order
    rotated every round (drifting load hits all alike); returns per case the medians and the
    loss and gradient differences of the first step (max over ranks)."""
    variants = {}
    for name, vp, cls in CASES:
        if name == "dualpipev" and m < 2 * world:
            continue
        topo = Topology(world, rank, tp=1, pp=world, vp=vp, pipeline_schedule=name).create_groups()
        variants[(name, "megazero")] = _megazero(topo, name, vp, m, b, s, h)
        variants[(name, "torch")] = _torch(topo, name, vp, cls, m, b, s, h)
    keys = list(variants)
    times, first = {k: [] for k in keys}, {}
    for i in range(warmup + steps):
        shift = i % len(keys)
        for k in keys[shift:] + keys[:shift]:
            chunks, run = variants[k]
            t, losses = _timed(run, chunks, i)
            if i == 0:
                first[k] = (losses, _grads(chunks))
            if i >= warmup:
                times[k].append(t)
    out = {}
    for name in dict.fromkeys(n for n, _ in keys):
        (lm, gm), (lt, gt) = first[(name, "megazero")], first[(name, "torch")]
        diff = torch.tensor([max([abs(a - c) for a, c in zip(lm, lt)] + [0.0]),
                             max([(a - c).abs().max().item() for a, c in zip(gm, gt)] + [0.0]),
                             float(len(lm) != len(lt))])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        out[name] = {impl: statistics.median(times[(name, impl)]) for impl in ("megazero", "torch")}
        out[name]["paired"] = statistics.median(a / c for a, c in zip(times[(name, "megazero")], times[(name, "torch")]))
        out[name].update(loss_diff=diff[0].item(), grad_diff=diff[1].item(), loss_count_differs=bool(diff[2]))
    return out


def report(res, pp, m) -> list[str]:
    lines = [f"{'schedule':16s} {'megazero ms':>12s} {'torch ms':>10s} {'mz/torch':>9s} {'per round':>9s} "
             f"{'mz/mz-1f1b':>10s} {'max|dloss|':>11s} {'max|dgrad|':>11s}"]
    base = res["1f1b"]["megazero"]
    for name, r in res.items():
        lines.append(f"{name:16s} {r['megazero'] * 1e3:12.1f} {r['torch'] * 1e3:10.1f} "
                     f"{r['megazero'] / r['torch']:9.3f} {r['paired']:9.3f} {r['megazero'] / base:10.3f} {r['loss_diff']:11.2e} "
                     f"{r['grad_diff']:11.2e}" + (" LOSS COUNT DIFFERS" if r["loss_count_differs"] else ""))
    return lines


def main(a) -> None:
    from megazero.testing import run_distributed
    torch.set_num_threads(1)
    print(f"PP={a.ranks} ranks (gloo, CPU, 1 thread each), M={a.micro_batches}, micro-batch [{a.micro_batch_size}, "
          f"{a.seq_length}, {a.hidden}], {LAYERS} blocks of megazero TP-1 linears; median of {a.steps} steps after "
          f"{a.warmup}, all variants round-robin")
    res = run_distributed(bench, a.ranks, a.micro_batches, a.micro_batch_size, a.seq_length, a.hidden, a.steps,
                          a.warmup, timeout_s=1800, collective_timeout_s=300)[0]
    print("\n".join(report(res, a.ranks, a.micro_batches)), flush=True)
