#!/usr/bin/env python
"""The whole GPU check in one command (< 8 minutes on one H200): a Markdown + JSON report.

    PYTHONPATH=. python3 bench/gpu_check.py --out runs/gpu_check          # on a CUDA machine
    PYTHONPATH=. python3 bench/gpu_check.py --out /tmp/gc --dry-run       # CPU only, tiny sizes (tests)

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``; exit status 0 when every check
passed (speed targets are reported, not enforced). Phases, each driven through the project's
command lines as a user would run them (``tools/preprocess_data.py``, ``pretrain_gpt.py``,
``bench/gpu_mfu.py``, ``bench/gpu_peer.py``, ``python -m megazero.planner``):

1. **environment** -- GPU name, memory, compute capability, driver (``nvidia-smi``), CUDA, torch, NCCL.
2. **correctness** -- the tiny GPT of ``tests/test_training.py`` (4 layers, hidden 32, seq 16,
   global batch 8, lr 1e-2, dropout 0) trained ``--iters`` (20) iterations through
   ``pretrain_gpt.py`` at world size 1, ZeRO 0 and ZeRO 3, fp32 and ``--bf16``, on the device
   (NCCL) and on the CPU (gloo, ``CUDA_VISIBLE_DEVICES=``), on a counting corpus (NullTokenizer,
   vocabulary 100) so the losses move. Pass: every iteration's loss within
   ``|dev - cpu| / |cpu| <= 1e-4`` (fp32) / ``3e-2`` (bf16). The fp32 ZeRO-0 CPU run's checkpoint
   is then decoded greedily (TP 1, fp32, KV cache) on the CPU and on the device: the tokens must
   be equal (``--generate-worker``: ``tools/generate.py``'s ``load_model`` + ``megazero.inference.generation``).
3. **speed** -- ``bench/gpu_mfu.py`` (1.34B Llama-style, bf16, ZeRO 1, micro-batch 4 x 8, seq 2048,
   flash SDPA) with selective recompute off and on: tokens/s, TFLOP/s, MFU; ``bench/gpu_peer.py``
   (the same model in plain PyTorch: autocast bf16, SDPA, fused AdamW) in the same run, and the
   ratio of tokens/s. Targets (issue 17): MFU >= 0.45, ratio >= 1.0.
4. **memory** -- gpu_mfu's ``torch.cuda.max_memory_allocated`` per phase (after build, first
   step, whole run) against ``python -m megazero.planner`` for the same flags (model states,
   activations, total).

``--dry-run`` runs every phase on the CPU with tiny sizes: the "device" is the CPU too, so each
correctness run is its own reference (4 runs, not 8) and the comparisons are trivially equal, but
every other line of the pipeline runs (``tests/test_gpu_check.py``).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_report  # noqa: E402  (bench/gpu_report.py: Markdown rendering and verdicts)

TINY_GPT = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
            "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
            "--seed", "7"]
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
LOSS_RE = re.compile(r"^(?: \[[^\]]*\])? iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.eE+-]+) \|", re.M)
PROMPTS = [[5, 6, 7, 8], [40, 42, 44], [90, 91]]
# The correctness matrix: (dtype, ZeRO stage, variant); "moe" swaps each MLP for 4 experts, top-2 (dropless,
# so the device and CPU runs route the same tokens to the same experts).
VARIANTS = {"dense": [], "moe": ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]}
MATRIX = [("fp32", 0, "dense"), ("fp32", 3, "dense"), ("bf16", 0, "dense"), ("bf16", 3, "dense"),
          ("fp32", 1, "moe")]


def sh(cmd: list, timeout: float, env: dict | None = None, cwd: Path = ROOT) -> str:
    """Run ``cmd``; its stdout, or RuntimeError with the output's tail."""
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env=env)
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))[:300]} -> exit {out.returncode}\n"
                           f"{(out.stdout + out.stderr)[-2500:]}")
    return out.stdout


def child_env(device: str, threads: int) -> dict:
    """A single-process environment: no launcher variables, the project on PYTHONPATH; the CPU
    runs see no GPU at all."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def environment(device: str) -> dict:
    """Versions and the GPU; every CUDA call behind ``torch.cuda.is_available()``."""
    import platform

    import torch
    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "device": device, "host_cpus": os.cpu_count()}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), cudnn=torch.backends.cudnn.version())
        try:
            info["driver"] = sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 30).strip()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            info["driver"] = f"unknown ({type(e).__name__})"
    else:
        info.update(gpu=None, note="dry run: every phase on the CPU, tiny sizes")
    return info


def make_corpus(work: Path, python: str) -> list[str]:
    """Counting documents (start a, stride 1..3, 48 tokens mod 97) -> an indexed dataset through
    ``tools/preprocess_data.py``; returns the data flags for pretrain_gpt.py."""
    work.mkdir(parents=True, exist_ok=True)
    src = work / "counting.jsonl"
    with open(src, "w") as f:
        for j in range(400):
            start, stride = (j * 7) % 97, 1 + j % 3
            f.write(json.dumps({"text": " ".join(str((start + stride * i) % 97) for i in range(48))}) + "\n")
    sh([python, "tools/preprocess_data.py", "--input", src, "--output-prefix", work / "counting",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"], 120, child_env("cpu", 1))
    return ["--data-path", str(work / "counting_text_document"), "--split", "100,0,0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def train_losses(python: str, device: str, dtype: str, zero: int, iters: int, data: list, threads: int,
                 save: Path | None, variant: str = "dense") -> list[float]:
    """One pretrain_gpt.py run at world size 1: the logged lm loss of every iteration."""
    cmd = [python, "pretrain_gpt.py", *TINY_GPT, *VARIANTS[variant], *data, "--train-iters", iters,
           "--zero-stage", zero]
    cmd += ["--bf16"] if dtype == "bf16" else []
    cmd += ["--distributed-backend", "gloo"] if device == "cpu" else []
    cmd += ["--save", save, "--save-interval", 100000] if save else []
    log = sh(cmd, 300, child_env(device, threads))
    losses = [float(m.group(2)) for m in LOSS_RE.finditer(log)]
    if len(losses) != iters:
        raise RuntimeError(f"{len(losses)} iteration lines, expected {iters}\n{log[-2000:]}")
    return losses


def correctness(a, data: list, work: Path) -> dict:
    """Device vs CPU losses for every MATRIX entry, all runs ``--jobs`` at a time."""
    roles = ("device", "cpu") if a.device != "cpu" else ("cpu",)  # dry run: the CPU run is its own reference
    runs = [(role, *m) for m in MATRIX for role in roles]
    ckpt = work / "ckpt_cpu_fp32_z0"
    with cf.ThreadPoolExecutor(a.jobs) as pool:
        futures = {r: pool.submit(train_losses, a.python, a.device if r[0] == "device" else "cpu", r[1], r[2],
                                  a.iters, data, a.cpu_threads if r[0] == "cpu" else 1,
                                  ckpt if r == ("cpu", "fp32", 0, "dense") else None, r[3]) for r in runs}
        losses = {r: f.result() for r, f in futures.items()}
    rows = []
    for dtype, zero, variant in MATRIX:
        ref = losses[("cpu", dtype, zero, variant)]
        dev = losses.get(("device", dtype, zero, variant), ref)
        rel = max(abs(x - y) / abs(y) for x, y in zip(dev, ref))
        rows.append({"dtype": dtype, "zero": zero, "variant": variant, "iters": len(ref), "device_losses": dev,
                     "cpu_losses": ref, "max_rel_diff": rel, "tolerance": TOLERANCE[dtype],
                     "pass": rel <= TOLERANCE[dtype]})
    return {"runs": rows, "checkpoint": str(ckpt)}


def generation(a, ckpt: str) -> dict:
    """Greedy tokens from the CPU fp32 checkpoint, decoded on the CPU and on the device."""
    tokens = {}
    for dev in dict.fromkeys([a.device, "cpu"]):
        out = sh([a.python, __file__, "--generate-worker", ckpt, "--device", dev, "--out", "-"], 300,
                 child_env(dev, a.cpu_threads))
        tokens[dev] = json.loads(out.strip().splitlines()[-1])["tokens"]
    dev, cpu = tokens[a.device], tokens["cpu"]
    return {"prompts": PROMPTS, "device_tokens": dev, "cpu_tokens": cpu, "pass": dev == cpu}


def generate_worker(load: str, device: str) -> None:
    """Print ``{"tokens": [...]}``: greedy continuations of PROMPTS (16 tokens, KV cache, fp32)."""
    import importlib.util

    import torch
    from megazero.inference.generation import generate
    spec = importlib.util.spec_from_file_location("mz_generate_tool", ROOT / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    dev = torch.device("cuda", 0) if device == "cuda" and torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda" and dev.type != "cuda":
        raise SystemExit("--device cuda: no CUDA device")
    model, _ = tool.load_model(load, None, dev, params_dtype="fp32")
    res = generate(model, [list(p) for p in PROMPTS], 16, eod=None, greedy=True)
    print(json.dumps({"tokens": [list(map(int, row)) for row in res.tokens]}), flush=True)


def last_json(text: str) -> dict:
    return json.loads([l for l in text.splitlines() if l.startswith("{")][-1])


def planner(a, flags: str, gpu_gib: float) -> dict:
    """``python -m megazero.planner`` for a gpu_mfu configuration (world size 1)."""
    out = sh([a.python, "-m", "megazero.planner", *flags.split(), "--world-size", "1", "--json",
              "--gpu-memory-gb", gpu_gib], 120, child_env("cpu", 1))
    plan = last_json(out)
    return {k: plan[k] for k in ("model_state_bytes", "activation_bytes", "total_bytes", "fits")}


def speed(a, gpu_gib: float) -> dict:
    """gpu_mfu with recompute off / selective, then the plain-PyTorch peer; planner figures."""
    size = ["--tiny", "--device", "cpu", "--threads", str(a.cpu_threads)] if a.device == "cpu" else []
    steps = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    env = child_env(a.device, a.cpu_threads)
    variants = []
    for recompute in (None, "selective"):
        cmd = [a.python, "bench/gpu_mfu.py", *size, *steps] + (["--recompute", recompute] if recompute else [])
        r = last_json(sh(cmd, a.timeout, env))
        r["planner"] = planner(a, r["megatron_flags"], gpu_gib)
        variants.append(r)
    peer = last_json(sh([a.python, "bench/gpu_peer.py", *size, *steps], a.timeout, env))
    base = variants[0]
    peer["achieved_tflops"] = float(f"{base['model_tflop_per_step'] * peer['tokens_per_s'] / base['tokens_per_step']:.4g}")
    for r in variants:
        r["vs_peer"] = round(r["tokens_per_s"] / peer["tokens_per_s"], 3)
    return {"megazero": variants, "peer": peer}


def phase(report: dict, name: str, fn, *args):
    """Run one phase; its result, or its error recorded in the report (the others still run)."""
    t0 = time.perf_counter()
    try:
        report[name] = fn(*args)
    except Exception as e:  # noqa: BLE001 -- the report says what failed
        report[name] = {"error": f"{type(e).__name__}: {e}"}
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    return report[name]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="report folder (gpu_check.json, gpu_check.md, work/)")
    p.add_argument("--dry-run", action="store_true", help="CPU only, tiny sizes: what the test suite runs")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default cuda (cpu with --dry-run)")
    p.add_argument("--iters", type=int, default=None, help="iterations of the correctness runs (20; dry run 6)")
    p.add_argument("--steps", type=int, default=None, help="timed speed steps (default 10; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed speed steps (default 3; dry run 1)")
    p.add_argument("--jobs", type=int, default=None, help="correctness runs at once (default 4; dry run 2)")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads per CPU run (default cores/jobs)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per speed run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--generate-worker", metavar="CKPT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.device = a.device or ("cpu" if a.dry_run else "cuda")
    if a.generate_worker:
        generate_worker(a.generate_worker, a.device)
        return 0
    a.dry_run = a.dry_run or a.device == "cpu"
    a.iters = a.iters or (6 if a.dry_run else 20)
    a.steps = a.steps or (2 if a.dry_run else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.dry_run else 3)
    a.jobs = a.jobs or (2 if a.dry_run else 4)
    a.cpu_threads = a.cpu_threads or max(1, (os.cpu_count() or 1) // a.jobs)
    out = Path(a.out)
    work = out / "work"
    t0 = time.perf_counter()
    report = {"issue": 17, "dry_run": a.dry_run, "argv": sys.argv[1:] if argv is None else list(argv)}
    env = phase(report, "environment", environment, a.device)
    data = phase(report, "corpus", make_corpus, work, a.python)
    corr = phase(report, "correctness", correctness, a, data, work) if isinstance(data, list) else {}
    if "checkpoint" in corr:
        phase(report, "generation", generation, a, corr["checkpoint"])
    phase(report, "speed", speed, a, env.get("gpu_memory_GiB") or 80.0)
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    ok = gpu_report.write(report, out)
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} in {report['total_seconds']} s; report {out / 'gpu_check.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
