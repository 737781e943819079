"""The whole training iteration: megazero's loop against a bare PyTorch loop, same model and batches.

    PYTHONPATH=. .venv/bin/python bench/loop.py [--stage 0 1 2 3] [--log-interval 1 100] [--ranks 4]
        [--iters 5] [--reps 3] [--warmup 1] [--layers 4] [--hidden 256] [--seq 128]
        [--micro-batch 4] [--global-batch 16] [--vocab 4096]

megazero: ``megazero.training.setup`` + ``Trainer.train`` from ``pretrain_gpt.py``'s flags (GPT,
mock data (vocabulary 4096), fp32, dropout 0, ``--clip-grad 1.0``, constant LR, ``--zero-stage S``,
``--log-interval L``), everything the loop does per iteration included (data, schedule, ZeRO
step, LR, loss agreement, log line). ``--exit-interval K`` makes each ``train()`` call one run of
``K`` iterations, so one trainer serves every repetition. Peer, on the same ``GPTModel`` (built
with the same name-seeded weights) and the same micro-batches (the same mock dataset and
Megatron sampler, read on the main thread): ZeRO 0/1/2 -> ``DistributedDataParallel`` +
``AdamW(foreach)`` + ``clip_grad_norm_`` + one ``barrier`` per iteration, the loss all-reduced
and read every ``L`` iterations; ZeRO 3 -> the same loop with FSDP2 ``fully_shard`` on each
transformer layer and the root.

Runs are interleaved (megazero then peer, peer then megazero on the next repetition) so that a
shared box's load hits both alike. Per run: the slowest rank's wall time / K (barrier before).
Prints JSON lines: ``config``, then per (stage, L) ``{"kind": "loop", "megazero_ms": median,
"peer_ms": median, "ratio": megazero/peer of the medians, "paired_ratio": median of per-repetition
ratios, "target", "met"}``; ``load`` (1-minute load average) before and after. Targets (issue 19):
<= 1.05 at L = 1, <= 1.03 at L = 100 for ZeRO 0-2; ZeRO 3 <= 1.0 x FSDP2.

This compares the loop and the ZeRO machinery only: the peer runs megazero's own model, so model-level
costs cancel. What a user sees -- ``pretrain_gpt.py``'s logged iteration time against an independent
plain-PyTorch GPT -- is ``bench/user_loop.py`` with ``bench/ddp_peer.py`` (docs/benchmarks.md, issue 33).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from megazero.testing import run_distributed


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


def _megazero(a, world: int, stage: int, log_interval: int):
    """A trainer; ``run()`` trains ``a.iters`` iterations (one ``train()`` call) and returns the
    number of log lines printed (on the last rank)."""
    from megazero.arguments import parse_args
    from megazero.training import setup
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = setup(parse_args(megatron_argv(a, stage, log_interval), world_size=world))

    def run():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            trainer.train(None)
        return sum(" iteration " in line for line in buf.getvalue().splitlines())
    return run, trainer.config


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

    def run(log_interval: int, indices) -> int:
        printed = 0
        for _ in range(a.iters):
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
                    printed += 1
                state["losses"].clear()
            dist.barrier()
        return printed
    return run, samples


def _cpu_seconds() -> float:
    """This process's user + system CPU time, all its threads (reader threads included)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _timed(run) -> tuple[float, float, int]:
    """(slowest rank's wall seconds, CPU seconds summed over the ranks, run's return value). The
    CPU time is the load-insensitive diagnostic: what the system costs whatever else runs."""
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu_seconds()
    value = run()
    t = torch.tensor([time.perf_counter() - t0])
    c = torch.tensor([_cpu_seconds() - c0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(c)
    return t.item(), c.item(), value


def _bench(rank, world, a):
    systems, peers = [], {}
    for stage in a.stage:
        for li in a.log_interval:
            mz, config = _megazero(a, world, stage, li)
            kind = "fsdp2" if stage == 3 else "ddp"
            if kind not in peers:
                peers[kind] = _peer(a, world, rank, config, fsdp=stage == 3)
            peer, samples = peers[kind]
            systems.append((stage, li, kind, mz, lambda peer=peer, li=li, it=samples(): peer(li, it)))
    times = {(s, li): {"megazero": [], "peer": []} for s, li, *_ in systems}
    cpu = {(s, li): {"megazero": [], "peer": []} for s, li, *_ in systems}
    logs = {(s, li): 0 for s, li, *_ in systems}
    for rep in range(a.warmup + a.reps):
        for stage, li, _, mz, peer in systems:
            order = (("megazero", mz), ("peer", peer)) if rep % 2 == 0 else (("peer", peer), ("megazero", mz))
            for name, run in order:
                t, c, printed = _timed(run)
                if rank == world - 1:
                    print(json.dumps({"kind": "run", "rep": rep, "stage": stage, "log_interval": li, "system": name,
                                      "ms": round(t / a.iters * 1000, 2), "cpu_ms": round(c / a.iters * 1000, 2),
                                      "load": os.getloadavg()[0]}), flush=True)
                if rep >= a.warmup:
                    times[(stage, li)][name].append(t / a.iters * 1000)
                    cpu[(stage, li)][name].append(c / a.iters * 1000)
                    logs[(stage, li)] += printed if name == "megazero" else 0
    return _results(a, systems, times, cpu, logs) if rank == world - 1 else None


def _results(a, systems, times, cpu, logs) -> list[dict]:
    lines = []
    for stage, li, kind, *_ in systems:
        mz, peer = times[(stage, li)]["megazero"], times[(stage, li)]["peer"]
        mz_cpu, peer_cpu = (statistics.median(cpu[(stage, li)][k]) for k in ("megazero", "peer"))
        ratio = statistics.median(mz) / statistics.median(peer)
        target = 1.0 if stage == 3 else (1.05 if li == 1 else 1.03)
        lines.append({"kind": "loop", "stage": stage, "log_interval": li, "peer": kind,
                      "megazero_ms": round(statistics.median(mz), 2), "peer_ms": round(statistics.median(peer), 2),
                      "ratio": round(ratio, 3),
                      "paired_ratio": round(statistics.median(x / y for x, y in zip(mz, peer)), 3),
                      "target": target, "met": ratio <= target,
                      "megazero_cpu_ms": round(mz_cpu, 1), "peer_cpu_ms": round(peer_cpu, 1),
                      "cpu_ratio": round(mz_cpu / peer_cpu, 3), "megazero_log_lines": logs[(stage, li)],
                      "megazero_runs_ms": [round(x, 1) for x in mz], "peer_runs_ms": [round(x, 1) for x in peer]})
    return lines


def markdown(lines: list[dict], load: str) -> list[str]:
    """The docs/benchmarks.md "Loop" table rows of one run's ``loop`` results."""
    out = ["| ZeRO | --log-interval | peer | megazero ms/iter | peer ms/iter | ratio (medians) | paired ratio | "
           "target | CPU ms/iter (megazero / peer) | load (1 min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for j in lines:
        out.append(f"| {j['stage']} | {j['log_interval']} | {j['peer']} | {j['megazero_ms']:.0f} | "
                   f"{j['peer_ms']:.0f} | "
                   f"**{j['ratio']:.2f}** | {j['paired_ratio']:.2f} | {j['target']} | "
                   f"{j['megazero_cpu_ms']:.0f} / {j['peer_cpu_ms']:.0f} = {j['cpu_ratio']:.2f} | {load} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--log-interval", type=int, nargs="+", default=[1, 100])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=5, help="iterations per run")
    p.add_argument("--reps", type=int, default=3, help="timed runs per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per system first")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)  # the issue-33 setup (was 1024)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    before = os.getloadavg()[0]
    print(json.dumps({"kind": "config", **vars(a), "load": before, "torch": torch.__version__}), flush=True)
    t0 = time.perf_counter()
    results = run_distributed(_bench, a.ranks, a, timeout_s=3600, collective_timeout_s=600)[-1]
    for line in results:
        print(json.dumps(line), flush=True)
    after = os.getloadavg()[0]
    print(json.dumps({"kind": "load", "after": after, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    print("\n".join(markdown(results, f"{before:.1f} -> {after:.1f}")), flush=True)


if __name__ == "__main__":
    main()
