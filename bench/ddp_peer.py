"""An independent plain-PyTorch peer of ``pretrain_gpt.py``'s iteration (issue 33).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 bench/ddp_peer.py --mode ddp|fsdp2 \
        [--layers 4 --hidden 256 --heads 8 --seq 128 --micro-batch 4 --global-batch 16 --vocab 4096 --iters 10]

No megazero import: a GPT written here (learned positions, pre-norm LayerNorm, fused QKV,
``scaled_dot_product_attention`` causal, GELU MLP of 4h, final LayerNorm, head tied to the word
embedding), under ``DistributedDataParallel`` (``--mode ddp``) or FSDP2 ``fully_shard`` on each
block and the root (``--mode fsdp2``), ``torch.optim.AdamW(lr=1e-4, weight_decay=0.01)``,
``clip_grad_norm_(1.0)``, the mean loss all-reduced and read (what a log line needs), then a
``barrier``; in-memory random batches, ``global / (micro * world)`` micro-batches per step with
``no_sync`` on all but the last (DDP). The step timer covers all of that, as megazero's
``elapsed time per iteration`` covers its whole iteration. Prints one JSON line (last rank):
``{"mode", "step_ms": [...], "median_ms": median of the steps after the first 3}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x + attn(ln1 x); x + mlp(ln2 x)."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(a, rank: int, world: int):
    """The peer of ``a`` (``mode``, sizes, ``iters`` unused) on this rank: ``step(it) -> ms``, one
    whole step (micro-batches, clipping, AdamW, the loss all-reduced and read, a barrier) timed.
    ``bench/loop.py`` runs it in its own ranks beside megazero's; :func:`main` under torchrun."""
    torch.manual_seed(1234)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    m = a.global_batch // (a.micro_batch * world)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=gen) for _ in range(8)]

    def step(it: int) -> float:
        t0 = time.perf_counter()
        total = torch.zeros(())
        for k in range(m):
            b = batches[(it * m + k) % len(batches)]
            sync = a.mode == "fsdp2" or k == m - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = model(b[:, :-1], b[:, 1:])
                (loss / m).backward()
            total += loss.detach() / m
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        total.item()
        dist.barrier()
        return (time.perf_counter() - t0) * 1000
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("seq", 128), ("micro-batch", 4),
                          ("global-batch", 16), ("vocab", 4096), ("iters", 10)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = build(a, rank, world)
    times = [step(it) for it in range(a.iters)]
    if rank == world - 1:
        print(json.dumps({"mode": a.mode, "step_ms": [round(t, 1) for t in times],
                          "median_ms": round(statistics.median(times[3:]), 2), "load": os.getloadavg()[0]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
