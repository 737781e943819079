"""Context parallelism at long sequence: per-rank peak memory, time per iteration and the
attention's communication of a GPT training step at CP 1, 2 and 4, ``--cp-comm-type`` p2p (the
ring) and a2a (Ulysses), against the formulas. Run one configuration after another::

    PYTHONPATH=. .venv/bin/python bench/context_parallel.py                  # seq 8192, CP 1/2/4 x p2p/a2a (~2.5 min)
    PYTHONPATH=. .venv/bin/python bench/context_parallel.py --seq 16384      # the longer sequence (~8 min)
    PYTHONPATH=. .venv/bin/python bench/context_parallel.py --seq 8192 16384 --iters 5 --json cp.json
    PYTHONPATH=. .venv/bin/python bench/context_parallel.py --process --seq 8192 --cp 1 4   # whole processes (~7 min)

Model: ``--layers`` 2, ``--hidden`` 128, ``--heads`` 4 (``--groups``: query groups, GQA), RoPE,
fp32, no dropout, vocabulary ``--vocab`` 1024, micro-batch 1, one micro-batch per step, ZeRO
stage 1 over DP x CP (``gpt_stages`` + ``PipelineRunner`` + ``ZeroOptimizer``, as
tests/context_parallel/test_equivalence.py builds them). Each rank is a forked gloo process with
one intra-op thread (``megazero.testing.run_distributed``); CP 1 is one process, whose attention
is ``F.scaled_dot_product_attention`` (on CPU a flash kernel: no ``s x s`` matrix).

Memory, bench/memory.py's method: each rank first fixes glibc's mmap threshold at 1 MiB
(``megazero.zero.host_memory.return_freed_memory``: every tensor of 1 MiB or more is its own
mapping, unmapped on free, so the resident set follows what is alive), runs ``--warmup`` steps
(the optimizer state appears there), reads its resident set, resets the kernel's peak
(``/proc/self/clear_refs`` = 5) and reads ``ru_maxrss`` after the timed steps. "step peak" =
that peak minus the resident set before: what a step adds on top of the model and optimizer
states (activations, their gradients, the attention's temporaries). A second phase runs one
attention call alone (one layer's ``q, k, v``; its forward's peak, then its backward's) the same way; for the ring
it is also given in fp32 score blocks ``b H L^2 4`` bytes, ``L = s / 2CP`` (the ring's block kernel
on CPU is the flash kernel, which forms none; its explicit fallback forms query-row tiles, at most
two alive). The largest rank's figures are shown.

Communication: each rank wraps ``torch.distributed.batch_isend_irecv`` (the ring's exchanges)
and ``all_to_all_single`` (Ulysses') in its own process and adds up the bytes it sends to other
ranks; megazero is not touched. Formulas per rank, layer and micro-batch, ``B = b G (s/CP) d 4``
bytes (one rank's K or V): ring forward ``(CP-1) 2B``, backward ``(CP-1) 2B`` (K, V ahead) plus
``CP 2B`` (fp32 dK, dV following their block home), counted together; Ulysses forward and
backward each ``(CP-1)/CP (2 H + 2 G) b (s/CP) d 4`` (q, k, v and the output, or their gradients).

``--process``: what a user measures. ``pretrain_gpt.py`` under torchrun (4 layers, hidden 64, 4
heads, 2 query groups, RoPE, SwiGLU, fp32, vocabulary 512, mock data, micro-batch 1, 2 iterations;
``PROCESS_FLAGS``) at each ``--seq`` and at ``--base-seq`` (128), CP 1 and CP 4, ``--repeat`` runs
of each, interleaved. Every rank reads its own ``ru_maxrss`` (the whole process: start-up, the first
step, the data reader, glibc's default allocator) and CPU seconds at exit. Per rank: the median
peak at ``--seq`` minus the median peak of the same layout at ``--base-seq``; the worst rank's is
compared with CP 1's (target ``--target``); CPU seconds added, summed over the ranks, likewise.

Time: the median over ``--iters`` steps of the slowest rank's wall time (each step starts at a
barrier), and the median per-rank CPU time (``time.process_time``): with more ranks than cores
the wall time also counts waiting for a core; "CPU x CP / CP 1" is the total CPU time against CP 1's
(target ``--cpu-target`` 1.3 for the ring).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel_process import MB, process_mode, ratio_text  # noqa: E402
from rss import peak_since_reset, reset_peak, rss_now  # noqa: E402



def count_comm(counts: collections.Counter) -> None:
    """Wrap this process's ``torch.distributed.batch_isend_irecv`` and ``all_to_all_single`` so
    that the bytes sent to other ranks add up in ``counts`` (``ring``: the ring's point-to-point
    exchanges, forward and backward; ``a2a``: all-to-all rows sent to peers)."""
    import torch.distributed as dist
    batch, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_isend_irecv(ops):
        sends = [op.tensor for op in ops if op.op is dist.isend]
        key = "ring"
        counts[key] += sum(t.numel() * t.element_size() for t in sends)
        counts[key + "_calls"] += 1
        return batch(ops)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        p, me, rows = dist.get_world_size(group), dist.get_rank(group), input.shape[0]
        splits = input_split_sizes or [rows // p] * p
        counts["a2a"] += (rows - splits[me]) * (input.numel() // max(rows, 1)) * input.element_size()
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.batch_isend_irecv, dist.all_to_all_single = batch_isend_irecv, all_to_all_single


def _config(o, seq: int, comm: str):
    import torch

    from megazero.model.config import GPTConfig
    return GPTConfig.from_megatron(dict(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, num_query_groups=o.groups or o.heads,
        seq_length=seq, max_position_embeddings=seq, attention_dropout=0.0, hidden_dropout=0.0,
        position_embedding_type="rope", params_dtype=torch.float32, cp_comm_type=comm,
        make_vocab_size_divisible_by=128), vocab_size=o.vocab)


def _trainer(o, seq: int, comm: str, topo):
    """A step function of the GPT on this rank (one micro-batch of ``seq`` tokens, ZeRO 1)."""
    import torch

    from megazero.model.stages import gpt_stages
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    config = _config(o, seq, comm)
    config.check_cp(topo.cp)
    stages = gpt_stages(config, topo, 1)
    opt = ZeroOptimizer(stages.chunks, topo, stage=1, num_micro_batches=1, lr=1e-4, params_dtype=torch.float32,
                        shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params)
    runner = PipelineRunner(topo, 1, stages.activation_shape, stages.activation_dtype)
    g = torch.Generator().manual_seed(0)  # the same sequence on every CP rank: each keeps its chunks
    batch = {"tokens": torch.randint(0, o.vocab, (1, seq), generator=g),
             "labels": torch.randint(0, o.vocab, (1, seq), generator=g),
             "loss_mask": torch.ones(1, seq)}

    def step():
        runner.run(stages.chunks, [batch], stages.forward_step, grad_scale=opt.loss_scale)
        assert opt.step()[0]
    return step


def _attention_peak(o, seq: int, comm: str, topo) -> tuple[int, int]:
    """Peak bytes one attention call adds in its forward and in its backward, this rank's
    shapes; the second of two calls (the first pages in code and pools, ~40 MiB once)."""
    import torch
    import torch.nn.functional as F

    from megazero.context_parallel.ring import ring_attention
    from megazero.context_parallel.ulysses import ulysses_attention
    cp, d, groups = topo.cp, o.hidden // o.heads, o.groups or o.heads
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, seq // cp, d, generator=g).requires_grad_() for n in (o.heads, groups, groups))
    do = torch.randn(1, o.heads, seq // cp, d, generator=g)
    for _ in range(2):
        before = rss_now()
        reset_peak()
        if cp == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != o.heads)
        elif comm == "p2p":
            out = ring_attention(q, k, v, topo.group("cp"), topo.rank_lists["cp"])
        else:
            out = ulysses_attention(q, k, v, topo.group("cp"), cp, enable_gqa=groups != o.heads)
        fwd = peak_since_reset() - before
        reset_peak()
        out.backward(do)
        peak = (fwd, peak_since_reset() - before)
        del out
        q.grad = k.grad = v.grad = None
    return peak


def _rank(rank, world, o, seq, comm):
    import torch.distributed as dist

    from megazero.parallel.topology import Topology
    from megazero.zero.host_memory import return_freed_memory
    return_freed_memory(1 << 20)
    counts = collections.Counter()
    count_comm(counts)
    topo = Topology(world, rank, cp=world).create_groups()
    step = _trainer(o, seq, comm, topo)
    for _ in range(o.warmup):
        step()
    counts.clear()
    before = rss_now()
    reset_peak()
    wall, cpu = [], []
    for _ in range(o.iters):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = peak_since_reset() - before
    sent = {k: v / o.iters for k, v in counts.items()}
    dist.barrier()
    return {"step_peak": peak, "resident": before, "wall": wall, "cpu": cpu, "sent": sent,
            "attention_peak": _attention_peak(o, seq, comm, topo)}


def formulas(o, seq: int, cp: int) -> dict:
    """Bytes one rank sends per step (all layers, one micro-batch), and one fp32 score block."""
    d, groups = o.hidden // o.heads, o.groups or o.heads
    kv = groups * (seq // cp) * d * 4
    local = (2 * o.heads + 2 * groups) * (seq // cp) * d * 4
    block = o.heads * (seq // (2 * cp)) ** 2 * 4
    # forward: CP - 1 hops of (K, V); backward: CP - 1 hops of (K, V) again and CP of (dK, dV) in fp32
    return {"ring": o.layers * ((cp - 1) * 2 * kv * 2 + cp * 2 * kv),
            "a2a": o.layers * 2 * (cp - 1) * local // cp, "block": block}


def run_config(o, seq: int, cp: int, comm: str) -> dict:
    from megazero.testing import run_distributed
    load = os.getloadavg()[0]
    ranks = run_distributed(_rank, cp, o, seq, comm, timeout_s=3600)
    sent = {k: max(r["sent"].get(k, 0) for r in ranks) for k in ("ring", "a2a")}
    return {"seq": seq, "cp": cp, "comm": comm if cp > 1 else "sdpa",
            "step_peak": max(r["step_peak"] for r in ranks),
            "attention_fwd": max(r["attention_peak"][0] for r in ranks),
            "attention_bwd": max(r["attention_peak"][1] for r in ranks),
            "resident": max(r["resident"] for r in ranks),
            "wall_s": statistics.median(max(r["wall"][i] for r in ranks) for i in range(o.iters)),
            "cpu_s": statistics.median(c for r in ranks for c in r["cpu"]),
            "sent": sent, "formula": formulas(o, seq, cp), "load_before": load}


def table(rows) -> str:
    """Markdown: one row per configuration; memory ratios against CP 1 at the same sequence."""
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    head = ["seq", "CP", "attention", "step peak MiB", "/ CP 1", "attention fwd / bwd MiB", "in score blocks",
            "wall s/step", "CPU s/step", "CPU x CP / CP 1", "sent fwd + bwd MiB (formula)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b, f, s = base.get(r["seq"]), r["formula"], r["sent"]
        kind = {"p2p": "ring", "a2a": "a2a"}.get(r["comm"])
        sent = f"{s[kind] / MB:.1f} ({f[kind] / MB:.1f})" if kind else "-"
        out.append("| " + " | ".join([
            str(r["seq"]), str(r["cp"]), r["comm"], f"{r['step_peak'] / MB:.0f}",
            ratio_text(r["step_peak"], b["step_peak"]) if b else "-",
            f"{r['attention_fwd'] / MB:.0f} / {r['attention_bwd'] / MB:.0f}",
            f"{r['attention_fwd'] / f['block']:.1f} / {r['attention_bwd'] / f['block']:.1f}"
            if r["comm"] == "p2p" else "-",
            f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", ratio_text(r["cpu_s"] * r["cp"], b["cpu_s"]) if b else "-",
            sent]) + " |")
    return "\n".join(out)


def print_targets(rows, o) -> None:
    """The targets at the largest CP, per row: the ring's CPU time (per rank x CP) and the step peak."""
    top = max(o.cp)
    for r in rows:
        base = next((b for b in rows if b["seq"] == r["seq"] and b["cp"] == 1), None)
        if not (base and r["cp"] == top > 1):
            continue
        checks = [("step peak", r["step_peak"] / base["step_peak"], o.target)]
        if r["comm"] == "p2p":
            checks.insert(0, ("CPU time (per rank x CP)", r["cpu_s"] * top / base["cpu_s"], o.cpu_target))
        for what, ratio, target in checks:
            print(f"target seq {r['seq']} CP {top} {r['comm']}: {what} {ratio:.2f} x CP 1 (target <= {target}): "
                  f"{'met' if ratio <= target else 'not met'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--comm", nargs="+", default=["p2p", "a2a"], choices=["p2p", "a2a"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=None, help="query groups (GQA); default: --heads")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--target", type=float, default=0.35, help="step peak at the largest CP / CP 1")
    p.add_argument("--cpu-target", type=float, default=1.3, help="the ring's CPU time x CP / CP 1's")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--process", action="store_true", help="the whole-process peak RSS of pretrain_gpt.py runs")
    p.add_argument("--base-seq", type=int, default=128, help="--process: the layout's baseline sequence")
    p.add_argument("--repeat", type=int, default=3, help="--process: runs of each configuration (medians)")
    o = p.parse_args(argv)
    if o.process:
        return process_mode(o, ROOT)
    rows = []
    for seq in o.seq:
        for cp in o.cp:
            for comm in (o.comm if cp > 1 else ["p2p"]):
                rows.append(run_config(o, seq, cp, comm))
                print(json.dumps(dict(rows[-1], kind="cp")), flush=True)
    print(table(rows))
    print_targets(rows, o)
    if o.json:
        with open(o.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
