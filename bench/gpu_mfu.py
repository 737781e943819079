#!/usr/bin/env python
"""Tokens/s and MFU of a ~1.3B GPT in bf16 on one CUDA GPU, through megazero's full training step.

    PYTHONPATH=. python bench/gpu_mfu.py                  # the ~1.3B model on cuda:0
    PYTHONPATH=. python bench/gpu_mfu.py --tiny           # a few-layer model on CPU: smoke test
    PYTHONPATH=. python bench/gpu_mfu.py --arch gpt2 --micro-batch-size 8 --zero-stage 0

The step is the training loop's, unchanged (``megazero.training.build``): model chunks from
``megazero.pipeline.build_model_chunks`` (one chunk, PP = 1), ``ZeroOptimizer`` (stage 0 or 1,
DP = 1: bf16 parameters, fp32 gradient accumulation, fp32 master weights, ``torch._foreach_*``
AdamW), one ``forward_backward`` over M micro-batches (gradient accumulation), then
``finish_grad_sync`` and ``step``. Attention runs through ``F.scaled_dot_product_attention``
(``is_causal=True``); dropout is 0 so SDPA is used (megazero runs attention explicitly when
attention dropout is active) and on CUDA the flash kernel is forced (``--sdpa-backend flash``;
it raises if flash cannot run). The only host sync per step is the optimizer's grad-norm read;
the micro-batches are random tokens made once, on the device.

Model (default ``--arch llama``): 24 layers, hidden 2048, 16 heads (head dim 128), SwiGLU
(FFN 5440), RoPE, RMSNorm, no linear biases, untied embeddings, vocab 32000, sequence 2048:
1.34B parameters. ``--arch gpt2``: GPT-3 XL shape (24 x 2048, FFN 8192, learned positions,
LayerNorm, biases, tied embeddings, vocab 50257): 1.32B.

MFU = model FLOPs per iteration (``megazero.training.logger.model_flops_per_iteration``, Megatron's
formula, causal attention counted in full) / (seconds per iteration x peak dense bf16 FLOP/s).
Peak from ``PEAK_BF16_TFLOPS`` by the GPU's name, or ``--peak-tflops``; none on CPU (MFU null).
Prints one JSON object: tokens/s, median / mean step time, TFLOP/s, MFU, peak memory, the GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets; the first
# key contained in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS = [
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("MI300X", 1307.0), ("MI250X", 383.0),
]

ARCHS = {
    "llama": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
              "--seq-length", "2048", "--vocab-size", "32000", "--swiglu", "--position-embedding-type", "rope",
              "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    "gpt2": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "50257"],
}
TINY = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
        "--vocab-size": "512", "--max-position-embeddings": "64"}


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in name.lower():
            return value
    return None


def megatron_argv(a) -> list[str]:
    """The Megatron flags of the benchmarked configuration (what pretrain_gpt.py would get)."""
    model = list(ARCHS[a.arch])
    if a.tiny:
        for i, tok in enumerate(model):
            if tok in TINY:
                model[i + 1] = TINY[tok]
        if "--max-position-embeddings" not in model:
            model += ["--max-position-embeddings", TINY["--max-position-embeddings"]]
    argv = model + [
        "--micro-batch-size", str(a.micro_batch_size),
        "--global-batch-size", str(a.micro_batch_size * a.num_micro_batches),
        "--train-iters", str(a.warmup + a.steps), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--zero-stage", str(a.zero_stage), "--mock-data"]
    if a.dtype == "bf16":
        argv.append("--bf16")
    elif a.dtype == "fp16":
        argv.append("--fp16")
    if a.recompute:
        argv += ["--recompute-granularity", a.recompute]
    return argv


def sdpa_context(backend: str, device: torch.device):
    if backend == "default" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend])


def micro_batches(args, vocab_size: int, device) -> list[dict]:
    """M micro-batches of random tokens, made once on ``device``."""
    g = torch.Generator(device=device).manual_seed(1234)
    b, s = args.micro_batch_size, args.seq_length
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    mbs = []
    for _ in range(args.num_micro_batches):
        text = torch.randint(0, vocab_size, (b, s + 1), device=device, generator=g)
        mbs.append({"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(), "position_ids": pos,
                    "loss_mask": torch.ones(b, s, device=device)})
    return mbs


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 3)


def timed_steps(a, trainer, mbs) -> dict:
    """Run warmup + timed steps; per-step seconds, window seconds, losses, norms, memory per phase.

    Memory phases (CUDA only; ``torch.cuda.max_memory_allocated`` since the previous mark):
    ``after_build`` (allocated once model and optimizer exist), ``peak_first_step`` (the first
    step's peak: activations + gradients + lazily made optimizer state), ``peak`` (whole run)."""
    device = trainer.device
    cuda = device.type == "cuda"
    mem = {"after_build": gib(torch.cuda.memory_allocated(device))} if cuda else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, norms = [], [], []
    with sdpa_context(a.sdpa_backend, device):
        for i in range(a.warmup + a.steps):
            if i == a.warmup:  # timed window starts here
                if cuda:
                    torch.cuda.synchronize(device)
                t_window = time.perf_counter()
            t0, ev = time.perf_counter(), None
            if cuda:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
            loss, ok, gnorm, _ = trainer.train_step(mbs, with_loss=False)  # one host sync: the packed norm
            if cuda:
                ev[1].record()
                if i == 0:
                    mem["peak_first_step"] = gib(torch.cuda.max_memory_allocated(device))
            times.append(ev if cuda else time.perf_counter() - t0)
            losses.append(loss if loss is not None else torch.tensor(float("nan")))  # the last stage's mean
            norms.append(gnorm)
        if cuda:
            torch.cuda.synchronize(device)
            mem["peak"] = gib(torch.cuda.max_memory_allocated(device))
        window = time.perf_counter() - t_window
    step_s = [e0.elapsed_time(e1) / 1e3 for e0, e1 in times] if cuda else times
    return {"step_s": step_s[a.warmup:], "window": window, "losses": [round(float(l), 4) for l in losses],
            "norms": norms, "memory": mem}


def run(a) -> dict:
    from megazero.arguments import parse_args
    from megazero.training import setup
    from megazero.training.logger import model_flops_per_iteration

    backend = None if a.device == "cuda" else "gloo"
    argv = megatron_argv(a)
    args = parse_args(argv, world_size=1, prog="gpu_mfu")
    if backend is not None:
        args = args.replace(distributed_backend=backend)
    if a.threads:
        torch.set_num_threads(a.threads)
    trainer = setup(args)  # the run's own build order: model, ZeRO optimizer, pipeline runner
    device, chunks, opt = trainer.device, trainer.chunks, trainer.optimizer
    if a.device == "cuda" and device.type != "cuda":
        raise SystemExit("no CUDA device: run with --tiny (or --device cpu) on CPU")
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    r = timed_steps(a, trainer, micro_batches(args, trainer.model_config.vocab_size, device))
    cuda = device.type == "cuda"
    per_iter = r["window"] / a.steps
    flops = model_flops_per_iteration(trainer.model_config, args.global_batch_size)
    tokens = args.global_batch_size * args.seq_length
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = a.peak_tflops or (peak_tflops(name) if cuda else None)
    return {
        "bench": "gpu_mfu", "date": datetime.date.today().isoformat(), "device": name,
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "arch": a.arch, "tiny": a.tiny, "params": n_params, "dtype": a.dtype, "zero_stage": args.zero_stage,
        "recompute": a.recompute, "sdpa_backend": a.sdpa_backend if cuda else "default (CPU)",
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "num_micro_batches": args.num_micro_batches, "tokens_per_step": tokens, "steps": a.steps, "warmup": a.warmup,
        "median_step_s": round(statistics.median(r["step_s"]), 5), "mean_step_s": round(per_iter, 5),
        "tokens_per_s": round(tokens / per_iter, 1),
        "model_tflop_per_step": float(f"{flops / 1e12:.4g}"),
        "achieved_tflops": float(f"{flops / per_iter / 1e12:.4g}"),
        "peak_tflops": peak, "mfu": float(f"{flops / per_iter / (peak * 1e12):.4g}") if peak else None,
        "max_memory_allocated_GiB": r["memory"].get("peak") if cuda else None, "memory_GiB": r["memory"] or None,
        "loss_first_last": [r["losses"][0], r["losses"][-1]], "grad_norm_last": r["norms"][-1],
        "skipped": opt.skipped_iterations,
        "megatron_flags": " ".join(argv),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers x 64 hidden, seq 64, on CPU (smoke test)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--arch", choices=list(ARCHS), default="llama")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--num-micro-batches", type=int, default=None, help="gradient accumulation M; default 8 (tiny: 2)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1], default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--recompute", choices=["selective", "full"], default=None,
                   help="activation recompute (default none: the 1.3B model fits an 80 GB GPU without it)")
    p.add_argument("--sdpa-backend", choices=["flash", "cudnn", "efficient", "default"], default="flash")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (tiny: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first; default 3 (tiny: 1)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak bf16 TFLOP/s")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    a.micro_batch_size = a.micro_batch_size or (2 if a.tiny else 4)
    a.num_micro_batches = a.num_micro_batches or (2 if a.tiny else 8)
    a.steps = a.steps or (3 if a.tiny else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    if a.device == "cpu":
        os.environ.pop("RANK", None)  # a single process on a private store, whatever launched us
        os.environ.pop("WORLD_SIZE", None)
    result = run(a)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
