"""The whole training iteration as a user sees it: megazero's logged iteration time against two
bare PyTorch loops' whole steps, same sizes (in the same ranks, or at ZeRO-3 in ranks of their own).

    PYTHONPATH=. .venv/bin/python bench/loop.py [--stage 0 1 2 3] [--log-interval 1] [--ranks 4]
        [--iters 5] [--reps 3] [--warmup 1] [--separate-ranks 3] [--layers 4] [--hidden 256] [--seq 128]
        [--micro-batch 4] [--global-batch 16] [--vocab 4096]

megazero: ``megazero.training.setup`` + ``Trainer.train`` from ``pretrain_gpt.py``'s flags (GPT,
mock data, fp32, dropout 0, ``--clip-grad 1.0``, constant LR, ``--zero-stage S``,
``--log-interval L``); its figure is what its log lines say, the ``elapsed time per iteration
(ms)`` (``--exit-interval K``: each ``train()`` call is one run of ``K`` iterations). Two peers,
each timed per whole step (micro-batches, ``clip_grad_norm_``, AdamW, the loss all-reduced and
read, a barrier) -- ZeRO 0/1/2 under ``DistributedDataParallel``, ZeRO 3 under FSDP2
``fully_shard`` per layer and on the root:

* ``peer``: a bare loop on megazero's own ``GPTModel`` (same name-seeded weights, the same mock
  batches through Megatron's sampler, read on the main thread inside the step): model costs
  cancel, so its ratio isolates the loop and the ZeRO machinery;
* ``independent``: ``bench/ddp_peer.py``'s plain-PyTorch GPT (nothing of megazero; in-memory
  batches), the peer of ``bench/user_loop.py``: its ratio includes megazero's model.

The two ratios agreeing (``agree``: within the larger half-spread of their per-repetition ratios)
says megazero's model costs what a plain PyTorch GPT costs. Each stage runs in ranks of its own
(``run_distributed`` per stage) so that one stage's process-wide setting -- ZeRO-3's fixed glibc
mmap threshold (``megazero.training.setup``: the smallest unit's gathered bytes) -- cannot tax the
others; at the stages of ``--separate-ranks`` (default 3) megazero and the peers also run in ranks
of their own, one launch per repetition each (a warm-up run and a timed one), the order
alternating, so the peers keep glibc's own policy as they would in a program of their own. Runs rotate their order every repetition. Prints JSON
lines: ``config``, per (stage, L) ``{"kind": "loop", "megazero_ms": median logged ms,
"peer_ms", "independent_ms": median step ms, "ratio", "paired_ratio", "independent_ratio",
"independent_paired_ratio", "agree", "target", "met", CPU ms per iteration per system}``,
then ``load``. Targets (issue 33): <= 1.05 for ZeRO 0-2 against DDP, ZeRO 3 <= 1.0 x FSDP2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import resource
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.testing import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def megatron_argv(a, stage: int, log_interval: int) -> list[str]:
    """pretrain_gpt.py's flags for one megazero system (training length: every run + warm-up)."""
    total = (a.warmup + a.reps) * a.iters
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.global_batch),
            "--train-iters", str(total), "--exit-interval", str(a.iters), "--log-interval", str(log_interval),
            "--mock-data", "--vocab-size", str(a.vocab), "--lr", "1e-4", "--lr-decay-style", "constant",
            "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--zero-stage", str(stage), "--distributed-backend", "gloo", "--seed", "1234"]


LOGGED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _megazero(a, world: int, stage: int, log_interval: int):
    """A trainer; ``run()`` trains ``a.iters`` iterations (one ``train()`` call) and returns the
    ``elapsed time per iteration (ms)`` of the log lines it printed (the last rank logs; the
    other ranks return [])."""
    from megazero.arguments import parse_args
    from megazero.training import setup
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = setup(parse_args(megatron_argv(a, stage, log_interval), world_size=world))

    def run():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            trainer.train(None)
        return [float(x) for x in LOGGED.findall(buf.getvalue())]
    return run, trainer.config


def _independent(a, world: int, rank: int, fsdp: bool):
    """``bench/ddp_peer.py``'s plain GPT in these ranks; ``run() -> [step ms]``."""
    spec = importlib.util.spec_from_file_location("bench_ddp_peer", os.path.join(HERE, "ddp_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    sizes = argparse.Namespace(mode="fsdp2" if fsdp else "ddp", layers=a.layers, hidden=a.hidden, heads=a.heads,
                               seq=a.seq, micro_batch=a.micro_batch, global_batch=a.global_batch, vocab=a.vocab)
    step, count = peer.build(sizes, rank, world), [0]

    def run():
        times = [step(count[0] + i) for i in range(a.iters)]
        count[0] += a.iters
        return times
    return run


def _peer(a, world: int, rank: int, config, fsdp: bool):
    """The bare loop on megazero's own ``GPTModel`` (TP = PP = 1, same weights); ``run(L)``."""
    from megazero.data.samplers import PretrainingSampler, collate, get_tokens_and_labels
    from megazero.model import GPTModel
    from megazero.parallel.topology import Topology
    from megazero.training.data import MockGPTDataset
    data, schedule = config.data, config.schedule
    model = GPTModel(config.model, Topology(world, rank).create_groups())
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    m = schedule.num_micro_batches
    dataset = MockGPTDataset(schedule.train_iters * schedule.global_batch_size, data.seq_length, data.vocab_size,
                             data.seed)
    position_ids = torch.arange(data.seq_length).unsqueeze(0).expand(data.micro_batch_size, -1)
    state = {"iteration": 0, "losses": []}
    sink = io.StringIO()  # the log line's destination (megazero's is captured the same way)

    def micro_step(k: int, indices) -> torch.Tensor:
        tokens, labels = get_tokens_and_labels(collate([dataset[i] for i in next(indices)]))
        sync = fsdp or k == m - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = model(tokens, position_ids=position_ids, labels=labels).float().mean()
            (loss / m).backward()
        return loss.detach()

    def samples():
        """Megatron's sampler from sample 0, again and again: each system reads what megazero reads."""
        while True:
            yield from PretrainingSampler(len(dataset), 0, data.micro_batch_size, rank, world)

    def run(log_interval: int, indices) -> list[float]:
        steps = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            state["losses"].append(torch.stack([micro_step(k, indices) for k in range(m)]).mean())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["iteration"] += 1
            if state["iteration"] % log_interval == 0:
                total = torch.stack(state["losses"]).mean()
                dist.all_reduce(total)
                loss = total.item() / world
                if rank == world - 1:
                    print(f" iteration {state['iteration']:8d} | lm loss: {loss:.6E} |", file=sink)
                state["losses"].clear()
            dist.barrier()
            steps.append((time.perf_counter() - t0) * 1000)
        return steps
    return run, samples


def _cpu_seconds() -> float:
    """This process's user + system CPU time, all its threads (reader threads included)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _timed(run) -> tuple[float, list]:
    """(CPU seconds summed over the ranks, run's return value: its per-iteration ms). The CPU
    time is the load-insensitive diagnostic: what the system costs whatever else runs."""
    dist.barrier()
    c0 = _cpu_seconds()
    value = run()
    c = torch.tensor([_cpu_seconds() - c0])
    dist.all_reduce(c)
    return c.item(), value


SYSTEMS = ("megazero", "peer", "independent")


def _bench(rank, world, a, stage: int, systems=SYSTEMS):
    """One stage's ``systems`` in these ranks: every (system, L) run ``a.warmup + a.reps`` times,
    the order rotating; returns (last rank) ``(ms, cpu)``: ``{(L, system): [per timed run]}``."""
    from megazero.arguments import parse_args
    from megazero.training.build import build_configs
    cells = []
    for li in a.log_interval:
        runs = {}
        if "megazero" in systems:
            runs["megazero"], config = _megazero(a, world, stage, li)
        else:  # the configs alone: no setup, so no process-wide malloc policy in these ranks
            with contextlib.redirect_stdout(io.StringIO()):
                config = build_configs(parse_args(megatron_argv(a, stage, li), world_size=world))
        if "peer" in systems:
            peer, samples = _peer(a, world, rank, config, fsdp=stage == 3)
            runs["peer"] = lambda peer=peer, li=li, it=samples(): peer(li, it)
        if "independent" in systems:
            runs["independent"] = _independent(a, world, rank, fsdp=stage == 3)
        cells.append((li, runs))
    ms = {(li, s): [] for li, _ in cells for s in systems}
    cpu = {(li, s): [] for li, _ in cells for s in systems}
    for rep in range(a.warmup + a.reps):
        for li, runs in cells:
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for name in order:
                c, per_iteration = _timed(runs[name])
                if rank != world - 1:
                    continue
                if name == "megazero" and len(per_iteration) != a.iters // li:
                    raise RuntimeError(f"megazero printed {len(per_iteration)} log lines in {a.iters} iterations "
                                       f"at --log-interval {li}")
                print(json.dumps({"kind": "run", "rep": rep, "stage": stage, "log_interval": li, "system": name,
                                  "ms": round(statistics.median(per_iteration), 2),
                                  "cpu_ms": round(c / a.iters * 1000, 2), "load": os.getloadavg()[0]}), flush=True)
                if rep >= a.warmup:
                    ms[(li, name)].append(statistics.median(per_iteration))
                    cpu[(li, name)].append(c / a.iters * 1000)
    return (ms, cpu) if rank == world - 1 else None


def _stage(a, stage: int, separate: bool) -> list[dict]:
    """One stage's rows. ``separate``: megazero and the two peers in ranks of their own, one
    launch per repetition each (a warm-up run, then one timed run), the order alternating; else
    all three in one set of ranks."""
    kind = "fsdp2" if stage == 3 else "ddp"
    if not separate:
        ms, cpu = run_distributed(_bench, a.ranks, a, stage, timeout_s=3600, collective_timeout_s=600)[-1]
    else:
        one = argparse.Namespace(**{**vars(a), "reps": 1})
        groups = [("megazero",), ("peer", "independent")]
        ms, cpu = defaultdict(list), defaultdict(list)
        for rep in range(a.reps):
            for systems in groups if rep % 2 == 0 else groups[::-1]:
                got_ms, got_cpu = run_distributed(_bench, a.ranks, one, stage, systems, timeout_s=3600,
                                                  collective_timeout_s=600)[-1]
                for key, v in got_ms.items():
                    ms[key] += v
                    cpu[key] += got_cpu[key]
    return [dict(_row(stage, li, kind, ms, cpu), ranks="separate" if separate else "shared") for li in a.log_interval]


def _row(stage: int, li: int, kind: str, ms: dict, cpu: dict) -> dict:
    """One (stage, L) result: medians over repetitions, ratios of medians and per repetition."""
    med = {s: statistics.median(ms[(li, s)]) for s in SYSTEMS}
    paired = {s: [x / y for x, y in zip(ms[(li, "megazero")], ms[(li, s)])] for s in ("peer", "independent")}
    half_spread = max((max(v) - min(v)) / 2 for v in paired.values())
    target = 1.0 if stage == 3 else 1.05
    row = {"kind": "loop", "stage": stage, "log_interval": li, "peer": kind, "target": target}
    for s in SYSTEMS:
        row[f"{s}_ms"] = round(med[s], 2)
        row[f"{s}_runs_ms"] = [round(x, 1) for x in ms[(li, s)]]
        row[f"{s}_cpu_ms"] = round(statistics.median(cpu[(li, s)]), 1)
    row.update(ratio=round(med["megazero"] / med["peer"], 3), paired_ratio=round(statistics.median(paired["peer"]), 3),
               independent_ratio=round(med["megazero"] / med["independent"], 3),
               independent_paired_ratio=round(statistics.median(paired["independent"]), 3),
               paired_ratios=[round(x, 3) for x in paired["peer"]],
               independent_paired_ratios=[round(x, 3) for x in paired["independent"]])
    row["agree"] = abs(row["paired_ratio"] - row["independent_paired_ratio"]) <= half_spread
    row["met"] = row["independent_paired_ratio"] <= target
    return row


def markdown(lines: list[dict], load: str) -> list[str]:
    """The docs/benchmarks.md table rows of one run's ``loop`` results."""
    out = ["| ZeRO | --log-interval | peer | megazero logged ms | peer / independent step ms | ratio vs peer "
           "(paired) | ratio vs independent (paired) | agree | target | CPU ms/iter (mz / peer / indep.) | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for j in lines:
        out.append(f"| {j['stage']} | {j['log_interval']} | {j['peer']} | {j['megazero_ms']:.0f} | "
                   f"{j['peer_ms']:.0f} / {j['independent_ms']:.0f} | {j['paired_ratio']:.3f} | "
                   f"**{j['independent_paired_ratio']:.3f}** | {j['agree']} | {j['target']} | "
                   f"{j['megazero_cpu_ms']:.0f} / {j['peer_cpu_ms']:.0f} / {j['independent_cpu_ms']:.0f} | {load} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--log-interval", type=int, nargs="+", default=[1])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=5, help="iterations per run")
    p.add_argument("--reps", type=int, default=3, help="timed runs per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per system first")
    p.add_argument("--separate-ranks", type=int, nargs="*", default=[3], choices=[0, 1, 2, 3],
                   help="stages whose peers run in ranks of their own, apart from megazero (default 3: its "
                   "process-wide malloc policy would tax them)")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("seq", 128), ("micro-batch", 4),
                          ("global-batch", 16), ("vocab", 4096)):  # the issue-33 setup
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    bad = [li for li in a.log_interval if li < 1 or a.iters % li]
    if bad:
        p.error(f"--iters {a.iters} must be a multiple of every --log-interval (megazero's figure is its "
                f"log lines), got {bad}")
    torch.set_num_threads(1)
    before = os.getloadavg()[0]
    print(json.dumps({"kind": "config", **vars(a), "load": before, "torch": torch.__version__}), flush=True)
    t0 = time.perf_counter()
    results = []
    for stage in a.stage:  # fresh ranks per stage (module docstring)
        results += _stage(a, stage, separate=stage in a.separate_ranks)
    for line in results:
        print(json.dumps(line), flush=True)
    after = os.getloadavg()[0]
    print(json.dumps({"kind": "load", "after": after, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    print("\n".join(markdown(results, f"{before:.1f} -> {after:.1f}")), flush=True)


if __name__ == "__main__":
    main()
