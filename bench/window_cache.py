#!/usr/bin/env python
"""Sliding-window generation on CPU: the KV cache a ``--window-size`` model holds, and greedy decode
speed, against the same model without a window.

A random Mistral-style GPT (4 layers, hidden 256, 8 heads / 2 KV groups, RoPE, RMSNorm, SwiGLU,
vocabulary 1000) continues ``--batch`` prompts of ``--prompt-len`` tokens by ``--new`` tokens, once
with ``--window-size W-1,0`` and once without. Bytes: the most the cache's key/value tensors hold
after any step (a manual prefill + decode loop over :class:`InferenceCache`, the steps
``generate`` takes); tokens/s: ``generate`` (prefill included), median of ``--repeats``, one thread.

    .venv/bin/python bench/window_cache.py [--window 64] [--batch 4] [--prompt-len 256] [--new 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.inference.cache import InferenceCache  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402


def model(window: int | None, seq: int) -> GPTModel:
    return GPTModel(GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                              vocab_size=1000, seq_length=seq, attention_dropout=0.0, hidden_dropout=0.0,
                              position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                              add_bias_linear=False, window_size=None if window is None else (window - 1, 0))).eval()


@torch.inference_mode()
def peak_cache_bytes(net: GPTModel, prompts: torch.Tensor, new: int) -> int:
    """Greedy decoding by hand (prefill, then one token a step); the largest K/V total held."""
    cache = InferenceCache(prompts.shape[0], prompts.shape[1] + new, window=net.config.window_left)
    step, peak = prompts, 0
    for _ in range(new):
        cache.prepare(step_len=step.shape[1])
        logits = net(step, inference_cache=cache)
        cache.advance()
        peak = max(peak, sum(t.numel() * t.element_size() for d in (cache.keys, cache.values) for t in d.values()))
        step = logits[:, -1, :1000].argmax(-1, keepdim=True)
    return peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=64, help="HF's sliding_window W (--window-size W-1,0)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (a.batch, a.prompt_len), generator=g)
    print(f"| window | KV cache held (MiB) | tokens/s (median of {a.repeats}) |\n|---|---|---|")
    for window in (None, a.window):
        net = model(window, a.prompt_len + a.new)
        held = peak_cache_bytes(net, prompts, a.new) / 2 ** 20
        rates = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = generate(net, prompts.tolist(), a.new)
            rates.append(out.new_tokens / (time.perf_counter() - t0))
        print(f"| {window or 'none'} | {held:.2f} | {statistics.median(rates):.0f} |")


if __name__ == "__main__":
    main()
