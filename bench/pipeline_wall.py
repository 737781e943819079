"""Wall time per iteration of the zero-bubble schedules against 1F1B, on CPU/gloo, PP 4.

    PYTHONPATH=. .venv/bin/python bench/pipeline_wall.py [--rounds 7] [--steps 3] [--hidden 256]
        [--seq 128] [--micro-batches 8] [--schedules zb-h1,zbv] [--pace 4 8 [--pace-rounds 9]]

Real compute: megazero's GPT (``gpt_stages``, untied, a small vocabulary), ``2 PP`` layers so a
chunk of the V has one layer and a 1F1B stage two, through ``PipelineRunner`` with the chunks'
``weight_grad_stores`` (each B input gradients, each W weight gradients). One thread per rank.

Alternating paired rounds: round ``i`` times 1F1B and schedule X back to back (X first on odd
rounds), ``--steps`` iterations each (rank 0's time between two barriers); the figure is the
median of the rounds' ratios X / 1F1B, printed beside the simulator's for each rank's traced
F, B and W. With fewer cores than ranks a rank idle in 1F1B's bubble lends its core to a busy
one, so no schedule can show its gain (4 ranks on 2 cores: CPU-bound, docs/benchmarks.md).

``--pace K``: dedicated-device emulation (:class:`PacedTrace`): every F, B and W runs its real
compute, then holds its rank to ``K x`` its calibrated time (:func:`_calibrate_ranks`, each rank
alone), so the ranks never contend for cores; p2p and the runner's work run at their real cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megazero.parallel.topology import Topology
from megazero.pipeline import PipelineRunner, ScheduleTrace, build_plan, simulate, split_backwards
from megazero.testing import run_distributed

VOCAB = 64
SPIN_S = 0.0015  # PacedTrace: the end of a slot is waited for spinning


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


def _variant(world, rank, schedule, args, models: dict):
    """Schedule ``schedule``'s timed step. Schedules that split the model the same way (1F1B and
    ZB-H1; ZBV and DualPipeV) run the same model instance from ``models`` (keyed by VP and
    placement), as a user switching schedules would: their compute is then the same tensors in
    the same memory, and an instance whose memory happens to run a few % slower cannot pose as
    a schedule's effect."""
    from megazero.model.stages import gpt_stages
    from megazero.pipeline import placement
    vp = 1 if schedule in ("1f1b", "zb-h1") else 2
    topo = Topology(world, rank, pp=world, vp=vp, pipeline_schedule=schedule).create_groups()
    key = (vp, placement(schedule))
    if key not in models:
        models[key] = gpt_stages(_config(args.hidden, args.seq, 2 * world), topo, args.micro_batch)
    stages = models[key]
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
    step.stages, step.mb = stages, mbs[0]
    step.split = split_backwards(runner.plans[(args.micro_batches, False)])
    return step


def _phase_times(trace) -> dict:
    """Median F, B, W span of this rank's traced step (seconds); W 0 when the plan has none."""
    spans = {"F": [], "B": [], "W": []}
    for _, cat, start, end, _ in trace.events:
        key = {"forward": "F", "backward": "B", "weight-grad": "W"}.get(cat)
        if key is not None:
            spans[key].append(end - start)
    return {k: statistics.median(v) if v else 0.0 for k, v in spans.items()}


def _calibrate_once(stages, mb, got: dict) -> None:
    """One timing of this rank's compute alone (no p2p, no other rank running), appended to
    ``got[(kind, chunk)]``; kinds ``F``/``B`` undivided, ``Fs``/``Bs``/``W`` with the store deferring
    (B then input gradients only, W the weight gradients). A chunk's input is a random activation
    (the tokens on the first virtual stage), its output gradient random (the loss on the last).
    Every weight already has a ``.grad``, so each timed backward accumulates into it, as in a step's
    micro-batches after the first (an undivided B writing fresh gradients while the split's W
    accumulates would charge the split an extra pass over the weights)."""
    for c, chunk in enumerate(stages.chunks):
        store = stages.weight_grad_stores[c]
        for split in (False, True):
            x = None if getattr(chunk, "pre_process", False) else \
                torch.randn(stages.activation_shape, requires_grad=True)
            ctx = (lambda: store.deferring(0)) if split else nullcontext
            t0 = time.perf_counter()
            with ctx():
                out = stages.forward_step(chunk, mb, x)
            grad = None if out.dim() == 0 else torch.randn_like(out)
            t1 = time.perf_counter()
            with ctx():
                torch.autograd.backward(out, grad)
            t2 = time.perf_counter()
            store.run(0)
            t3 = time.perf_counter()
            for kind, dt in zip(("Fs", "Bs", "W") if split else ("F", "B"), (t1 - t0, t2 - t1, t3 - t2)):
                got.setdefault((kind, c), []).append(dt)


def _calibrate_ranks(steps, reps=9) -> dict:
    """Each variant's compute times (:func:`_calibrate_once`), one rank at a time (the others wait
    at a barrier), so no two ranks share the cores while timing; the variants interleaved
    repetition by repetition (a burst of the host's other load hits them alike, not one variant's
    whole calibration), after one untimed repetition (which also gives every weight its
    ``.grad``); the least of ``reps`` (others' load only adds time): ``{name: {(kind, chunk): s}}``."""
    cal = {}
    for r in range(dist.get_world_size()):
        dist.barrier()
        if dist.get_rank() == r:
            got = {name: {} for name in steps}
            for i in range(reps + 1):
                for name, fn in steps.items():
                    _calibrate_once(fn.stages, fn.mb, got[name] if i else {})
            cal = {name: {k: min(v) for k, v in t.items()} for name, t in got.items()}
            for fn in steps.values():
                for chunk in fn.stages.chunks:
                    chunk.zero_grad(set_to_none=True)
        dist.barrier()
    return cal


class PacedTrace(ScheduleTrace):
    """Dedicated-device emulation: the runner calls :meth:`record` after each action; an F, B
    or W then holds its rank until ``K x`` its calibrated compute time has passed since the
    action began (the action's slot), so a rank computes at most ``1/K`` of the time and ``PP``
    ranks on ``PP/K`` cores or more never wait for a core. The compute is real (same losses and
    gradients); the p2p exchanges and the runner's own work run outside the slots at their real
    cost. ``slots``: ``{(kind, chunk): seconds}`` from :func:`_calibrate_ranks` (a B whose
    micro-batch has a W in the plan takes ``Bs``, its F ``Fs``); counts ``overruns`` (actions
    that took longer than their slot: not held) and ``late`` (summed overshoot past the slots' ends, s)."""

    def __init__(self, cal, split, k):
        super().__init__()
        self.cal, self.split, self.k = cal, split, k
        self.actions = self.overruns = 0
        self.late = 0.0

    def record(self, action, start, end):
        if action.kind != "COMM":
            defer = (action.mb, action.chunk) in self.split
            kind = action.kind + ("s" if defer and action.kind in "FB" else "")
            until = start + self.k * self.cal[(kind, action.chunk)]
            self.actions += 1
            if end > until:
                self.overruns += 1
            else:  # sleep, then spin the last SPIN_S (a late wake-up would lengthen every slot)
                time.sleep(max(0.0, until - end - SPIN_S))
                while (end := time.perf_counter()) < until:
                    pass
                self.late += end - until
        super().record(action, start, end)


def _rounds(steps, schedules, rounds, n, trace=lambda name: None):
    """Alternating paired rounds: ``ratios[X]`` (X's median over 1F1B's, per round) and the
    medians ``times[name]``; ``trace(name)`` gives each step's trace (None: unpaced)."""
    ratios = {name: [] for name in schedules}
    times = {name: [] for name in ["1f1b"] + schedules}
    for i in range(rounds):
        for name in schedules:
            pair = ("1f1b", name) if i % 2 == 0 else (name, "1f1b")
            got = {x: statistics.median(steps[x](trace(x)) for _ in range(n)) for x in pair}
            ratios[name].append(got[name] / got["1f1b"])
            for x in pair:
                times[x].append(got[x])
    return ratios, times


def _bench(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    names = ["1f1b"] + args.schedules
    models: dict = {}
    steps = {name: _variant(world, rank, name, args, models) for name in names}
    for fn in steps.values():
        fn()  # warm-up (allocations, first-touch)
    phases = {}
    for name, fn in steps.items():
        trace = ScheduleTrace()
        fn(trace)
        phases[name] = _phase_times(trace)
    out = {"unpaced": _rounds(steps, args.schedules, args.rounds, args.steps), "phases": phases}
    if args.pace:
        out["cal"] = cal = _calibrate_ranks(steps)
        for k in args.pace:
            traces = {name: PacedTrace(cal[name], fn.split, k) for name, fn in steps.items()}
            out[k] = _rounds(steps, args.schedules, args.pace_rounds, 1, traces.get)
            out[("overruns", k)] = {n: (t.overruns, t.actions, t.late) for n, t in traces.items()}
    return out


def _predicted(world, m, name, phase) -> float:
    """The simulator's makespan of ``name`` over 1F1B's for rank-0-measured F, B and W times of
    ``name``'s chunks (its B is input gradients only: 1F1B's backward of a stage of ``vp``
    chunks costs ``vp (t_b + t_w)``)."""
    vp = 1 if name in ("1f1b", "zb-h1") else 2
    t_f, t_b, t_w = phase["F"], phase["B"], phase["W"]
    zb = simulate([build_plan(world, vp, m, r, schedule=name) for r in range(world)], t_f, t_b, t_w)
    base = simulate([build_plan(world, 1, m, r, schedule="1f1b") for r in range(world)], t_f * vp, (t_b + t_w) * vp)
    return zb["makespan"] / base["makespan"]


def _predicted_calibrated(world, m, name, cals) -> float:
    """The simulator's ratio for the calibrated times (means over ranks and chunks): ``name``
    with its deferring F, its input-gradient B and its W; 1F1B with its own F and undivided B."""
    def mean(n, kind):
        return statistics.mean(v for cal in cals for (k, _), v in cal[n].items() if k == kind)
    vp = 1 if name in ("1f1b", "zb-h1") else 2
    zb = simulate([build_plan(world, vp, m, r, schedule=name) for r in range(world)],
                  mean(name, "Fs"), mean(name, "Bs"), mean(name, "W"))
    base = simulate([build_plan(world, 1, m, r, schedule="1f1b") for r in range(world)],
                    mean("1f1b", "F"), mean("1f1b", "B"), 0.0)
    return zb["makespan"] / base["makespan"]


def _split_overhead(args, repeats=40) -> dict:
    """One process, one thread, no pipeline: a 1F1B stage's GPT chunk (2 layers, embedding and
    head) run as F + full B and as F + split B + W (its store deferring), alternated; medians
    in ms -- the split backward's own cost, free of the host's other ranks."""
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


def _table(title, args, ratios, times, predicted, overruns=None):
    print(f"\n{title}\n| schedule | median s/iter | vs 1F1B (median of paired rounds) | rounds' ratios | simulator |"
          + (" overruns |" if overruns else "") + "\n|---|---|---|---|---|" + ("---|" if overruns else ""))
    for name in ["1f1b"] + args.schedules:
        rs = ", ".join(f"{r:.2f}" for r in ratios.get(name, []))
        med = f"{statistics.median(ratios[name]):.3f}" if name in ratios else "1"
        pred = f"{predicted[name]:.3f}" if name in predicted else "1"
        extra = ""
        if overruns:
            over, n, late = (sum(x) for x in zip(*(o[name] for o in overruns)))
            extra = f" {over}/{n} (past slot end {1e3 * late / max(n - over, 1):.3f} ms/slot) |"
        print(f"| {name} | {statistics.median(times[name]):.3f} | {med} | {rs} | {pred} |" + extra)


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
    p.add_argument("--pace", type=float, nargs="*", default=[],
                   help="dedicated-device emulation: each F/B/W holds its rank for K x its calibrated time")
    p.add_argument("--pace-rounds", type=int, default=9, help="paired rounds per --pace K (one step each)")
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
    first = results[0]
    pred = {n: _predicted(args.ranks, args.micro_batches, n, first["phases"][n]) for n in args.schedules}
    _table("unpaced (real compute, ranks share the cores); simulator: rank 0's traced F/B/W", args,
           *first["unpaced"], pred)
    print("rank 0 phase medians (s): " + "; ".join(f"{n}: F {ph['F']:.4f} B {ph['B']:.4f} W {ph['W']:.4f}"
                                                   for n, ph in first["phases"].items()))
    if not args.pace:
        return
    cals = [r["cal"] for r in results]
    pred = {n: _predicted_calibrated(args.ranks, args.micro_batches, n, cals) for n in args.schedules}
    for k in args.pace:
        _table(f"paced K = {k:g} (dedicated-device emulation); simulator: calibrated means; load "
               f"{os.getloadavg()[0]:.1f}", args, *first[k], pred, [r[("overruns", k)] for r in results])
    for r, cal in enumerate(cals):
        print(f"rank {r} calibrated ms: " + "; ".join(
            f"{n}: " + " ".join(f"{k}{c} {1e3 * v:.2f}" for (k, c), v in sorted(t.items())) for n, t in cal.items()))


if __name__ == "__main__":
    main()
