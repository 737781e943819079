#!/usr/bin/env python
"""MLA decoding at long context on CPU: weight absorption against re-expanding the latent cache.

A random DeepSeek-like GPT scaled down (``--layers`` MLA layers, hidden 512, ``--heads`` heads,
``kv_lora_rank`` 512, ``qk_head_dim`` 128, ``qk_pos_emb_head_dim`` 64, ``v_head_dim`` 128,
``q_lora_rank`` 384, vocabulary 1000) prefills one prompt of ``t`` tokens into a
:class:`~megazero.inference.latent_cache.LatentCache`, then decodes ``2 --steps`` greedy tokens,
switching ``cache.absorb`` every step (absorbed / expanded alternate, so both see the same load and
contexts ``t .. t + 2 steps``). Per context: the median wall time of a decode step (the whole model:
embedding, every layer, head) of each mode, and the attention FLOPs per decode step and layer by
formula (batch 1; :mod:`megazero.inference.latent_cache`'s module doc)::

    expanded   2 t r H (d_n + d_v)  +  2 t H (d_q + d_v)
    absorbed   2 H r (d_n + d_v)    +  2 t H (2 r + d_r)

One intra-op thread.

    .venv/bin/python bench/mla_absorb.py [--contexts 1024 2048 4096] [--steps 8] [--heads 4] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.inference.latent_cache import LatentCache  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402

R, D_N, D_R, D_V = 512, 128, 64, 128


def model(heads: int, layers: int, seq: int) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(num_layers=layers, hidden_size=512, num_attention_heads=heads, vocab_size=1000,
                              seq_length=seq, attention_dropout=0.0, hidden_dropout=0.0, ffn_hidden_size=1024,
                              position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                              add_bias_linear=False, untie_embeddings_and_output_weights=True,
                              multi_latent_attention=True, q_lora_rank=384, kv_lora_rank=R, qk_head_dim=D_N,
                              qk_pos_emb_head_dim=D_R, v_head_dim=D_V)).eval()


def flops(t: int, heads: int) -> tuple[float, float]:
    """Attention FLOPs per decode step and layer (batch 1): expanded, absorbed."""
    expanded = 2 * t * R * heads * (D_N + D_V) + 2 * t * heads * (D_N + D_R + D_V)
    absorbed = 2 * heads * R * (D_N + D_V) + 2 * t * heads * (2 * R + D_R)
    return expanded, absorbed


@torch.inference_mode()
def decode_times(net: GPTModel, t: int, steps: int) -> dict[bool, list[float]]:
    """Prefill ``t`` random tokens, then ``2 steps`` decode steps alternating absorbed / expanded."""
    cache = LatentCache(1, t + 2 * steps, config=net.config)
    prompt = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
    cache.prepare(step_len=t)
    nxt = net(prompt, inference_cache=cache)[:, -1:, :1000].argmax(-1)
    cache.advance()
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * steps):
        cache.absorb = step % 2 == 0
        t0 = time.perf_counter()
        cache.prepare(step_len=1)
        nxt = net(nxt, inference_cache=cache)[:, -1:, :1000].argmax(-1)
        cache.advance()
        times[cache.absorb].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=8, help="decode steps per mode and context")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    net = model(a.heads, a.layers, max(a.contexts) + 2 * a.steps)
    print(f"MLA decode, batch 1, {a.layers} layers, H {a.heads}, r_kv {R}, d_n {D_N}, d_r {D_R}, d_v {D_V}, "
          f"{a.steps} steps per mode, one thread, load {os.getloadavg()[0]:.2f}")
    print("| context t | expanded ms/token | absorbed ms/token | speed-up | attention GFLOP/step/layer "
          "expanded | absorbed |")
    print("|---|---|---|---|---|---|")
    for t in a.contexts:
        times = decode_times(net, t, a.steps)
        exp, absd = (statistics.median(times[m]) * 1e3 for m in (False, True))
        f_exp, f_abs = flops(t, a.heads)
        print(f"| {t} | {exp:.2f} | {absd:.2f} | {exp / absd:.1f}x | {f_exp / 1e9:.3f} | {f_abs / 1e9:.4f} |",
              flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
