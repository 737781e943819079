#!/usr/bin/env python
"""The plain-PyTorch peer of ``bench/gpu_mfu.py``: the same Llama-style model, nanoGPT-style.

    python bench/gpu_peer.py                  # the ~1.34B model on cuda:0, bf16 autocast
    python bench/gpu_peer.py --tiny           # 2 layers x 64 hidden, seq 64, on CPU (smoke test)

No megazero code: one ``nn.Module`` (token embedding; per layer RMSNorm -> fused QKV (no bias)
-> RoPE (theta 10000, rotate-half) -> ``F.scaled_dot_product_attention(is_causal=True)`` ->
output projection, RMSNorm -> SwiGLU ``w2(silu(w1 x) * w3 x)``; final RMSNorm; untied output
layer), fp32 parameters, ``torch.autocast`` bf16 for forward and loss, ``torch.optim.AdamW``
(``fused=True`` on CUDA; lr 3e-4, betas (0.9, 0.95), weight decay 0.1), gradient clipping 1.0,
M micro-batches of gradient accumulation per step. This is what a user writes without a
framework, so megazero's tokens/s over the peer's is a meaningful ratio (``bench/gpu_check.py``).

Shapes default to gpu_mfu's ``--arch llama``: 24 x 2048, 16 heads, FFN 5440 (Megatron's SwiGLU
size ``64 floor(8h/3/64)``), vocab 32000 (padded to 32000: already a multiple of 128), seq 2048,
micro-batch 4, M = 8. Random tokens made once on the device; timing as in gpu_mfu (CUDA events
per step, wall clock over the timed window after ``--warmup`` steps). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FULL = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=32000)
TINY = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512)


def ffn_size(h: int) -> int:
    return int(8 * h / 3 / 64) * 64 or 64


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [b, heads, s, d]``; ``cos``/``sin`` are ``[s, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, f = heads, ffn_size(h)
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        z = self.norm2(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


class Llama(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(hidden, eps=1e-5), nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        ang = torch.outer(torch.arange(seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def sdpa_flash(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def train(a, device: torch.device) -> tuple[list, float, list, int]:
    """Per-step seconds (CUDA events / perf counter), timed-window seconds, losses, parameter count."""
    shape = TINY if a.tiny else FULL
    torch.manual_seed(0)
    model = Llama(**shape).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    g = torch.Generator(device=device).manual_seed(1234)
    b, s, M = a.micro_batch_size, shape["seq"], a.num_micro_batches
    data = [torch.randint(0, shape["vocab"], (b, s + 1), device=device, generator=g) for _ in range(M)]
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    times, losses = [], []
    with sdpa_flash(device):
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                t_window = time.perf_counter()
            t0, ev = time.perf_counter(), None
            if cuda:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
            opt.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            for text in data:
                with amp:
                    loss = model(text[:, :-1], text[:, 1:]) / M
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if cuda:
                ev[1].record()
            times.append(ev if cuda else time.perf_counter() - t0)
            losses.append(total)
        if cuda:
            torch.cuda.synchronize(device)
        window = time.perf_counter() - t_window
    step_s = [e0.elapsed_time(e1) / 1e3 for e0, e1 in times] if cuda else times
    n_params = sum(p.numel() for p in model.parameters())
    return step_s[a.warmup:], window, [round(float(l), 4) for l in losses], n_params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--num-micro-batches", type=int, default=None, help="default 8 (tiny: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (tiny: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first; default 3 (tiny: 1)")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    a = p.parse_args(argv)
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    a.micro_batch_size = a.micro_batch_size or (2 if a.tiny else 4)
    a.num_micro_batches = a.num_micro_batches or (2 if a.tiny else 8)
    a.steps = a.steps or (3 if a.tiny else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny (or --device cpu) on CPU")
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # initializes CUDA: resetting the peak stats before that raises
        torch.cuda.reset_peak_memory_stats(device)
    step_s, window, losses, n_params = train(a, device)
    seq = (TINY if a.tiny else FULL)["seq"]
    tokens = a.micro_batch_size * a.num_micro_batches * seq
    print(json.dumps({
        "bench": "gpu_peer", "model": "nanoGPT-style Llama, fp32 params, bf16 autocast, SDPA, AdamW"
        + (" (fused)" if device.type == "cuda" else ""), "device": str(device), "params": n_params,
        "tiny": a.tiny, "tokens_per_step": tokens, "steps": a.steps, "warmup": a.warmup,
        "median_step_s": round(statistics.median(step_s), 5), "mean_step_s": round(window / a.steps, 5),
        "tokens_per_s": round(tokens * a.steps / window, 1), "loss_first_last": [losses[0], losses[-1]],
        "max_memory_allocated_GiB": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                                     if device.type == "cuda" else None)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
