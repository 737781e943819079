"""Per-rank peak resident memory by phase, bytes written per checkpoint and bytes read per rank on
load, for ZeRO stages 0-3 at several DP sizes on a >= 100M-parameter bf16 GPT, against the ZeRO
formulas. Run one configuration after another (never two at once)::

    PYTHONPATH=. .venv/bin/python bench/memory.py                       # stages 0-3 x DP 2, 4; 8 x 1024, Φ 152M
    PYTHONPATH=. .venv/bin/python bench/memory.py --build-only --stages 3 --dp 8 --layers 16 --hidden 2048
    PYTHONPATH=. .venv/bin/python bench/memory.py --dp 4 --stages 1 3 --mmap-threshold 1048576
    PYTHONPATH=. .venv/bin/python bench/memory.py --dp 2 4 --stages 2 --reduce-bucket-size 20000000
    (the saving step with and without --async-save: bench/save_timing.py)

Each rank is a forked process (``megazero.testing.run_distributed``, one intra-op thread). Before a
phase it resets its kernel peak-RSS counter (``/proc/self/clear_refs`` = 5, Linux) and after it
reads ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the phase's own peak, whatever came before.
Phases: ``build`` (``training.setup``: the model -- on the meta device under ZeRO-3 -- and the
optimizer), ``step`` (1 training iteration), ``save`` (format 3), ``load`` (the same layout: the
exact path) and ``reshard`` (the previous configuration's checkpoint into this layout).

Formulas, Φ parameters, N = DP, p = 2 (bf16), g = 4 (bf16 gradients accumulate in fp32):
model states per rank ``(p+g+12)Φ`` / ``(p+g)Φ + 12Φ/N`` / ``pΦ + (g+12)Φ/N`` / ``(p+g+12)Φ/N``
(``ZeroOptimizer.state_bytes()["formula"]``); bound per phase = 1.15 x (interpreter + formula +
largest unit's full parameters and gradient (stage 3; else the largest fp32 draw, or at stage 2
the largest reduce bucket's full gradient if larger: it lives until the bucket's reduce-scatter is
done, so ``--reduce-bucket-size`` sets it; the default 5e8 makes it the whole model's) + activations,
``sbh(34 + 5as/h)L`` + fp32 logits x 3). A checkpoint should hold one copy of the weights and
fp32 state, ``(p + 12)Φ`` = 14Φ (the gradient is not saved); a rank's exact load reads its
fp32 shard, ``12Φ/N`` (``12Φ`` at ZeRO 0). Loading reads memory-mapped files, whose touched pages
(clean page cache the kernel may drop) count in RSS: the load and reshard bounds add the bytes read.
``--mmap-threshold BYTES``: each rank first calls ``megazero.zero.host_memory.return_freed_memory``
(freed blocks of at least BYTES leave the resident set; glibc's default keeps them in its heap);
without it the ranks keep glibc's default (``setup(..., fix_mmap_threshold=False)``);
``--mmap-threshold setup``: ``training.setup``'s own policy (stage 3: 1 MiB for the build, then the
smallest unit's gathered bytes; glibc's default at stages 0-2), ``--policy tight`` passing
``--zero-host-memory-policy tight`` (1 MiB at every stage, never raised). ``--mmap-ab``: iteration
time with and without 1 MiB; ``--policy-ab``: with ``--zero-host-memory-policy`` speed and tight.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rss import peak_since_reset, reset_peak, rss_now  # noqa: E402

GB = 1e9


@contextlib.contextmanager
def _phase(peaks: dict, name: str):
    reset_peak()
    t0 = time.time()
    yield
    peaks[name] = peak_since_reset()
    peaks[name + "_s"] = time.time() - t0


def model_flags(o, stage: int, dp: int, iters: int = 1) -> list[str]:
    return ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", str(o.heads),
            "--seq-length", str(o.seq), "--max-position-embeddings", str(o.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(dp), "--train-iters", str(iters), "--lr", "1e-4"] + (
            ["--bf16"] if o.dtype == "bf16" else []) + [
            "--mock-data", "--vocab-size", "50257", "--zero-stage", str(stage), "--log-interval", "100",
            "--eval-iters", "0", "--eval-interval", "1000", "--distributed-backend", "gloo",
            "--zero-max-reuse-distance", "0", "--seed", "1"] + (
            ["--zero-reduce-bucket-size", str(o.reduce_bucket_size)] if o.reduce_bucket_size else []) + (
            ["--zero-host-memory-policy", o.policy] if getattr(o, "policy", None) else [])


def _sizes(opt) -> dict:
    """Model-state bytes (actual, formula), Φ, and the transient the bound adds: the largest of
    a stage-3 unit's full parameters and gradient, the largest fp32 weight draw and the largest
    stage-2 bucket's full gradient (``bucket``, also returned alone)."""
    sb = opt.state_bytes()
    units = [r.padded for r in opt.regions if r.partitioned]
    draw = 4 * max(p.numel() for r in opt.regions for p in r.params)
    unit = max(units) * (sb["param_bytes"] + sb["grad_bytes"]) if units else 0
    buckets = [r.padded * r.grad_bytes for r in opt.regions if not r.persistent_grad and not r.partitioned]
    return {"states": sb["total"], "formula": sb["formula"], "phi": sb["phi"], "unit": max([unit, draw] + buckets),
            "bucket": max(buckets, default=0)}


def _rank(rank, world, argv, out_dir, prev_dir, build_only, mmap_threshold=None):
    from megazero.arguments import parse_args
    from megazero.checkpoint import schema
    from megazero.training import setup
    from megazero.training.build import build_configs
    from megazero.optim.lr_schedule import build_lr_scheduler
    from megazero.zero.host_memory import return_freed_memory
    peaks = {"interpreter": rss_now()}
    own_policy = mmap_threshold == "setup"
    if mmap_threshold and not own_policy:  # before anything large is allocated (megazero.zero.host_memory)
        return_freed_memory(mmap_threshold)
    args = parse_args(argv, world_size=world)
    with _phase(peaks, "build"):  # the malloc policy is --mmap-threshold's (glibc's default without it)
        trainer = setup(args, fix_mmap_threshold=None if own_policy else False)
    result = dict(peaks, **_sizes(trainer.optimizer))
    if build_only:
        return result
    with _phase(result, "step"):
        trainer.train(None)
    with _phase(result, "save"):
        trainer.config = build_configs(args.replace(save=out_dir))
        trainer.save()
    result["written"] = os.path.getsize(schema.rank_file(schema.iteration_dir(out_dir, 1), rank))
    with _phase(result, "load"):
        trainer.config = build_configs(args.replace(load=out_dir))
        trainer.load()
    result["read_load"] = trainer.load_bytes
    if prev_dir:
        with _phase(result, "reshard"):
            # its batch size follows its DP size: keep this run's LR schedule (the flags' settings)
            trainer.config = build_configs(args.replace(load=prev_dir, override_opt_param_scheduler=True))
            trainer.scheduler = build_lr_scheduler(trainer.config.schedule.lr)
            trainer.load()
        result["read_reshard"] = trainer.load_bytes
    return result


def _activations(o) -> float:
    s, h, a = o.seq, o.hidden, o.heads
    return s * h * (34 + 5 * a * s / h) * o.layers + 3 * 4 * s * 50304


def run_config(o, stage: int, dp: int, out_dir: str, prev_dir: str | None) -> dict:
    from megazero.testing import run_distributed
    ranks = run_distributed(_rank, dp, model_flags(o, stage, dp), out_dir, prev_dir, o.build_only, o.mmap_threshold,
                            timeout_s=7200)
    r0 = ranks[0]
    bound = 1.15 * (statistics.median(r["interpreter"] for r in ranks) + r0["formula"] + r0["unit"] + _activations(o))
    phases = [p for p in ("build", "step", "save", "load", "reshard") if p in r0]
    row = {"stage": stage, "dp": dp, "phi": r0["phi"], "formula": r0["formula"], "states": r0["states"],
           "transient": r0["unit"], "bucket": r0["bucket"], "interpreter": statistics.median(r["interpreter"] for r in ranks), "bound": bound,
           "peaks": {p: max(r[p] for r in ranks) for p in phases},
           "seconds": {p: statistics.median(r[p + "_s"] for r in ranks) for p in phases}}
    if not o.build_only:
        row["written"] = sum(r["written"] for r in ranks) + os.path.getsize(os.path.join(out_dir, "iter_0000001",
                                                                                        "metadata.json"))
        row["read_load"] = max(r["read_load"] for r in ranks)
        row["read_reshard"] = max(r.get("read_reshard", 0) for r in ranks)
    return row


def _table(rows, build_only: bool) -> str:
    phases = ["build"] if build_only else ["build", "step", "save", "load", "reshard"]
    head = ["ZeRO", "DP", "Φ (M)", "states / formula (GB)", "unit, draw or bucket (GB)", "bound (GB)"] + [f"{p} peak (GB)" for p in phases]
    if not build_only:
        head += ["written / 14Φ", "read on load / 12Φ/N", "read on reshard (GB)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["stage"]), str(r["dp"]), f"{r['phi'] / 1e6:.0f}",
                 f"{r['states'] / GB:.2f} / {r['formula'] / GB:.2f}",
                 f"{r['transient'] / GB:.2f}", f"{r['bound'] / GB:.2f}"]
        for p in phases:  # loading maps the files: the touched (clean, reclaimable) pages count in RSS
            bound = r["bound"] + r.get({"load": "read_load", "reshard": "read_reshard"}.get(p, ""), 0)
            cells.append("-" if p not in r["peaks"] else
                         f"{r['peaks'][p] / GB:.2f}" + ("" if r["peaks"][p] <= bound else " (over)"))
        if not build_only:
            share = 12 * r["phi"] / (r["dp"] if r["stage"] >= 1 else 1)
            cells += [f"{r['written'] / GB:.2f} GB = {r['written'] / (14 * r['phi']):.3f}",
                      f"{r['read_load'] / GB:.2f} GB = {r['read_load'] / share:.3f}",
                      f"{r['read_reshard'] / GB:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _mmap_rank(rank, world, argv, mmap_threshold, runs):
    """(wall, CPU = user + system) seconds of each ``train()`` call (``--exit-interval``
    iterations) after one warm-up call. ``mmap_threshold`` "setup": ``setup``'s own policy
    (``--zero-host-memory-policy`` in ``argv``)."""
    import io

    import torch.distributed as dist

    from megazero.arguments import parse_args
    from megazero.training import setup
    from megazero.zero.host_memory import return_freed_memory
    if mmap_threshold and mmap_threshold != "setup":
        return_freed_memory(mmap_threshold)
    times = []
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = setup(parse_args(argv, world_size=world), fix_mmap_threshold=None if mmap_threshold == "setup"
                        else False)
        for _ in range(runs + 1):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train(None)
            c1 = time.process_time()
            dist.barrier()
            times.append((time.perf_counter() - t0, c1 - c0))
    return times[1:]


def mmap_ab(o, stage: int, dp: int, pairs: int = 3, iters: int = 5, runs: int = 2, policies: bool = False) -> dict:
    """Iteration time with and without ``return_freed_memory(1 MiB)`` (``policies``: with
    ``setup``'s ``--zero-host-memory-policy speed`` as "default" and ``tight`` as "fixed"):
    ``pairs`` pairs of processes, the order alternating (default first on even pairs); each
    times ``runs`` calls of ``iters`` iterations after a warm-up call. Ratio = median(fixed) /
    median(default) per iteration, of the slowest rank's wall time and of the ranks' mean CPU
    time (user + system: the page faults of fresh mappings are system time)."""
    from megazero.testing import run_distributed
    argv = model_flags(o, stage, dp, iters=(runs + 1) * iters) + ["--exit-interval", str(iters)]
    wall, cpu = {"default": [], "fixed": []}, {"default": [], "fixed": []}
    for k in range(pairs):
        for mode in (("default", "fixed") if k % 2 == 0 else ("fixed", "default")):
            flags = ["--zero-host-memory-policy", "tight" if mode == "fixed" else "speed"] if policies else []
            threshold = "setup" if policies else 1 << 20 if mode == "fixed" else None
            ranks = run_distributed(_mmap_rank, dp, argv + flags, threshold, runs, timeout_s=3600)
            wall[mode] += [max(r[i][0] for r in ranks) / iters for i in range(runs)]
            cpu[mode] += [sum(r[i][1] for r in ranks) / len(ranks) / iters for i in range(runs)]
    out = {}
    for name, times in (("wall", wall), ("cpu", cpu)):  # CPU: per rank and iteration, mean over ranks
        med = {m: statistics.median(v) for m, v in times.items()}
        out[name] = {"s_per_iter": times, "median_s": med, "ratio": med["fixed"] / med["default"]}
    return out


def _threshold_arg(value: str):
    """``--mmap-threshold``: a byte count, or ``setup`` for ``training.setup``'s own policy."""
    if value == "setup" or value.isdigit():
        return value if value == "setup" else int(value)
    raise argparse.ArgumentTypeError(f"expected a number of bytes or 'setup', got {value!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--build-only", action="store_true", help="build and optimizer allocation only")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--mmap-threshold", type=_threshold_arg, default=None,
                   help="BYTES: each rank calls megazero.zero.host_memory.return_freed_memory(BYTES) before the "
                   "build (glibc M_MMAP_THRESHOLD); 'setup': training.setup's own policy; without it glibc's default")
    p.add_argument("--reduce-bucket-size", type=int, default=None, help="--zero-reduce-bucket-size (default: "
                   "megazero's, 5e8, DeepSpeed's); at stage 2 a bucket's full gradient is the step's transient")
    p.add_argument("--rounds", type=int, default=3, help="--mmap-ab: pairs of processes")
    p.add_argument("--mmap-ab", action="store_true", help="iteration time with and without "
                   "return_freed_memory(1 MiB), interleaved (first --stages / --dp value, --rounds pairs)")
    p.add_argument("--policy", choices=["speed", "tight"], default=None,
                   help="--zero-host-memory-policy for the runs (with --mmap-threshold setup: setup applies it)")
    p.add_argument("--policy-ab", action="store_true", help="--mmap-ab between --zero-host-memory-policy speed "
                   "(default) and tight (fixed), each applied by setup")
    o = p.parse_args(argv)
    if o.mmap_ab or o.policy_ab:
        load_avg = os.getloadavg()[0]
        print(json.dumps(dict(mmap_ab(o, o.stages[0], o.dp[0], pairs=o.rounds, policies=o.policy_ab),
                              load_before=load_avg,
                              load_after=os.getloadavg()[0])))
        return 0
    work = tempfile.mkdtemp(prefix="megazero_memory_")
    rows, prev = [], None
    try:
        for dp in o.dp:
            for stage in o.stages:
                out = os.path.join(work, f"z{stage}dp{dp}")
                load_avg = os.getloadavg()[0]
                rows.append(dict(run_config(o, stage, dp, out, prev), load_before=load_avg,
                                 mmap_threshold=o.mmap_threshold, policy=o.policy))
                print(json.dumps(rows[-1]), flush=True)
                if prev:
                    shutil.rmtree(prev, ignore_errors=True)
                prev = None if o.build_only else out
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_table(rows, o.build_only))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
