#!/usr/bin/env python
"""Greedy generation throughput on CPU: megazero (KV cache / recompute, TP 1 / 2) vs transformers.

One random GPT-2 of the demo's size (4 layers, hidden 128, 4 heads, vocabulary 4096, 128
positions) is built in transformers and loaded into megazero (``megazero.checkpoint.convert.hf.load_hf``), so
both generate from the same weights; the tokens are checked equal. Each system generates
``--new`` tokens after a ``--prompt-len``-token prompt for a batch of ``--batch`` rows, no eod.
tokens/s = batch x new / wall time of the whole generate call (prefill included); every process
runs one intra-op thread (TP 2 = two processes, one thread each). Systems run round-robin for
``--repeats`` rounds so load on a shared machine hits them alike; the table gives the median
and the ratio to transformers' ``generate(do_sample=False)`` with its KV cache.

    .venv/bin/python bench/generate.py [--repeats 5] [--batch 1 8] [--new 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.checkpoint.convert.hf import config_from_hf, load_hf  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402


def hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=4096, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def megazero_model(hf_config, hf_state, topo=None):
    model = GPTModel(config_from_hf(hf_config, attention_dropout=0.0, hidden_dropout=0.0), topo).eval()
    load_hf(model, hf_state)
    return model


def time_megazero(model, prompts, new, use_cache):
    t0 = time.perf_counter()
    res = generate(model, prompts, new, eod=None, use_cache=use_cache)
    return time.perf_counter() - t0, res.tokens


@torch.inference_mode()
def time_hf(hf, prompts, new, use_cache):
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def _tp_worker(rank, world, hf_config, hf_state, prompts, new):
    from megazero.parallel.topology import Topology
    topo = Topology(world, rank, tp=world).create_groups()
    model = megazero_model(hf_config, hf_state, topo)
    time_megazero(model, prompts[:1], 4, True)  # warm-up
    return {"cache": time_megazero(model, prompts, new, True), "recompute": time_megazero(model, prompts, new, False)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    hf = hf_model()
    hf_config, hf_state = hf.config.to_dict(), {k: v.clone() for k, v in hf.state_dict().items()}
    mz = megazero_model(hf_config, hf_state)
    rows = []
    for b in args.batch:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, 4096, (b, args.prompt_len), generator=g).tolist()
        time_hf(hf, prompts[:1], 4, True), time_megazero(mz, prompts[:1], 4, True)  # warm-up
        times = {k: [] for k in ("hf cache", "hf recompute", "mz TP1 cache", "mz TP1 recompute",
                                 "mz TP2 cache", "mz TP2 recompute")}
        same = True
        for _ in range(args.repeats):
            t, ref = time_hf(hf, prompts, args.new, True)
            times["hf cache"].append(t)
            t, toks = time_hf(hf, prompts, args.new, False)
            times["hf recompute"].append(t)
            for name, cache in (("mz TP1 cache", True), ("mz TP1 recompute", False)):
                t, toks = time_megazero(mz, prompts, args.new, cache)
                times[name].append(t)
                same &= toks == ref
            tp2 = run_distributed(_tp_worker, 2, hf_config, hf_state, prompts, args.new, timeout_s=600)[0]
            for kind in ("cache", "recompute"):
                times[f"mz TP2 {kind}"].append(tp2[kind][0])
                same &= tp2[kind][1] == ref
        base = statistics.median(times["hf cache"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append((b, name, b * args.new / med, base / med, same))
    print(f"\ngreedy generation, GPT-2 4x128 (vocab 4096), prompt {args.prompt_len}, {args.new} new tokens, "
          f"1 thread per process, median of {args.repeats}, torch {torch.__version__}\n")
    print("| batch | system | tokens/s | vs transformers (KV cache) | same tokens as transformers |")
    print("|---:|---|---:|---:|---|")
    for b, name, tps, ratio, same in rows:
        print(f"| {b} | {name} | {tps:.0f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
