"""Wall time per iteration of the zero-bubble schedules against 1F1B, on CPU/gloo, PP 4.

    PYTHONPATH=. .venv/bin/python bench/pipeline_wall.py [--rounds 7] [--steps 3] [--hidden 256]
        [--seq 128] [--micro-batches 8] [--schedules zb-h1,zbv]

Real compute: megazero's GPT (``gpt_stages``: TP/SP linears, attention, MLP, the embedding and
the untied output layer), ``2 PP`` layers so every virtual stage of the V has one layer and
every 1F1B stage two (stage times comparable; a small vocabulary so the embedding and the head
weigh little), through ``PipelineRunner`` with the chunks' ``weight_grad_stores`` (split
backward: each B computes input gradients, each W weight gradients). One thread per rank.

Design: alternating paired rounds. Round ``i`` times 1F1B and schedule X back to back (X first
on odd rounds), ``--steps`` iterations each after one warm-up, the iteration time being rank 0's
time between two barriers (so the slowest rank's); the round's ratio is X's median over 1F1B's
median, and the figure is the median of the rounds' ratios. Each rank also times its own F, B
and W (``ScheduleTrace``) so the simulator's prediction for the measured ``t_f, t_b, t_w`` is
printed beside the measured ratio.

Read with the host in mind: PP ranks on fewer cores share them, and a rank idle in 1F1B's bubble
then gives its core to a busy one -- the bubble a zero-bubble schedule removes is partly not a
loss on such a host, so the measured ratio stays above the simulator's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from megazero.parallel.topology import Topology
from megazero.pipeline import PipelineRunner, ScheduleTrace, build_plan, simulate
from megazero.testing import run_distributed

VOCAB = 64


def _config(hidden, seq, layers):
    from megazero.model.config import GPTConfig
    return GPTConfig.from_megatron(dict(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                                        seq_length=seq, max_position_embeddings=seq, attention_dropout=0.0,
                                        hidden_dropout=0.0, make_vocab_size_divisible_by=4,
                                        untie_embeddings_and_output_weights=True, params_dtype=torch.float32),
                                   vocab_size=VOCAB)


def _batches(m, b, s):
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, VOCAB, (b, s), generator=g), "labels": torch.randint(0, VOCAB, (b, s), generator=g),
             "loss_mask": torch.ones(b, s)} for _ in range(m)]


def _variant(world, rank, schedule, args):
    from megazero.model.stages import gpt_stages
    vp = 1 if schedule in ("1f1b", "zb-h1") else 2
    topo = Topology(world, rank, pp=world, vp=vp, pipeline_schedule=schedule).create_groups()
    stages = gpt_stages(_config(args.hidden, args.seq, 2 * world), topo, args.micro_batch)
    runner = PipelineRunner(topo, args.micro_batches, stages.activation_shape, stages.activation_dtype)
    mbs = _batches(args.micro_batches, args.micro_batch, args.seq)

    def step(trace=None):
        for c in stages.chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        runner.run(stages.chunks, mbs, stages.forward_step, trace=trace, weight_grad_stores=stages.weight_grad_stores)
        dist.barrier()
        return time.perf_counter() - t0
    return step


def _phase_times(trace) -> dict:
    """Median F, B, W span of this rank's traced step (seconds); W 0 when the plan has none."""
    spans = {"F": [], "B": [], "W": []}
    for _, cat, start, end, _ in trace.events:
        key = {"forward": "F", "backward": "B", "weight-grad": "W"}.get(cat)
        if key is not None:
            spans[key].append(end - start)
    return {k: statistics.median(v) if v else 0.0 for k, v in spans.items()}


def _bench(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    names = ["1f1b"] + args.schedules
    steps = {name: _variant(world, rank, name, args) for name in names}
    for fn in steps.values():
        fn()  # warm-up (allocations, first-touch)
    phases = {}
    for name, fn in steps.items():
        trace = ScheduleTrace()
        fn(trace)
        phases[name] = _phase_times(trace)
    ratios = {name: [] for name in args.schedules}
    times = {name: [] for name in names}
    for i in range(args.rounds):
        for name in args.schedules:
            pair = ("1f1b", name) if i % 2 == 0 else (name, "1f1b")
            got = {n: statistics.median(steps[n]() for _ in range(args.steps)) for n in pair}
            ratios[name].append(got[name] / got["1f1b"])
            for n in pair:
                times[n].append(got[n])
    return ratios, times, phases


def _predicted(world, m, name, phase) -> float:
    """The simulator's makespan of ``name`` over 1F1B's for rank-0-measured F, B and W times of
    ``name``'s chunks (its B is input gradients only: 1F1B's backward of a stage of ``vp``
    chunks costs ``vp (t_b + t_w)``)."""
    vp = 1 if name in ("1f1b", "zb-h1") else 2
    t_f, t_b, t_w = phase["F"], phase["B"], phase["W"]
    zb = simulate([build_plan(world, vp, m, r, schedule=name) for r in range(world)], t_f, t_b, t_w)
    base = simulate([build_plan(world, 1, m, r, schedule="1f1b") for r in range(world)], t_f * vp, (t_b + t_w) * vp)
    return zb["makespan"] / base["makespan"]


def _split_overhead(args, repeats=40) -> dict:
    """One process, one thread, no pipeline: a 1F1B stage's GPT chunk (2 layers, embedding and
    head) run as F + full B and as F + split B + W (its store deferring), alternated; medians
    in ms -- the split backward's own cost, free of the host's other ranks."""
    from contextlib import nullcontext

    from megazero.model import GPTModel
    from megazero.model.stages import gpt_forward_step
    from megazero.tensor_parallel.weight_grad_store import WeightGradStore
    torch.set_num_threads(1)
    model = GPTModel(_config(args.hidden, args.seq, 2), None)
    store = WeightGradStore().attach(model)
    mb = _batches(1, args.micro_batch, args.seq)[0]
    spans = {k: [] for k in ("full F", "full B", "split F", "split B", "split W")}
    for i in range(repeats + 2):
        for mode in (("full", "split") if i % 2 else ("split", "full")):
            model.zero_grad(set_to_none=True)
            ctx = (lambda: store.deferring(0)) if mode == "split" else nullcontext
            t0 = time.perf_counter()
            with ctx():
                loss = gpt_forward_step(model, mb, None)
            t1 = time.perf_counter()
            with ctx():
                loss.backward()
            t2 = time.perf_counter()
            store.run(0)
            t3 = time.perf_counter()
            if i >= 2:  # warm-up
                spans[f"{mode} F"].append(t1 - t0)
                spans[f"{mode} B"].append(t2 - t1)
                if mode == "split":
                    spans["split W"].append(t3 - t2)
    return {k: 1e3 * statistics.median(v) for k, v in spans.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=["zb-h1", "zbv"])
    p.add_argument("--split-overhead", action="store_true",
                   help="only the one-process F/B/W timing of a stage's chunk, full vs split backward")
    args = p.parse_args(argv)
    if args.split_overhead:
        ms = _split_overhead(args)
        print(" ".join(f"{k} {v:.2f} ms;" for k, v in ms.items()),
              f"split B + W over full B: {(ms['split B'] + ms['split W']) / ms['full B']:.3f}")
        return
    print(f"# PP {args.ranks}, M {args.micro_batches}, micro-batch {args.micro_batch} x seq {args.seq}, hidden "
          f"{args.hidden}, {2 * args.ranks} layers; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    results = run_distributed(_bench, args.ranks, args, timeout_s=3600)
    ratios, times, phases = results[0]
    print("| schedule | median s/iter | vs 1F1B (median of paired rounds) | rounds' ratios | "
          "simulator's ratio for the measured F/B/W |")
    print("|---|---|---|---|---|")
    print(f"| 1f1b | {statistics.median(times['1f1b']):.3f} | 1 | | |")
    for name in args.schedules:
        pred = _predicted(args.ranks, args.micro_batches, name, phases[name])
        rs = ", ".join(f"{r:.2f}" for r in ratios[name])
        print(f"| {name} | {statistics.median(times[name]):.3f} | {statistics.median(ratios[name]):.3f} | {rs} | "
              f"{pred:.3f} |")
    print("rank 0 phase medians (s): " + "; ".join(f"{n}: F {ph['F']:.4f} B {ph['B']:.4f} W {ph['W']:.4f}"
                                                   for n, ph in phases.items()))


if __name__ == "__main__":
    main()
