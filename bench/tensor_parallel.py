"""Step time (fwd + bwd) of a GPT layer stack: megazero TP+SP vs PyTorch's DTensor TP+SP.

For TP = 2 and 4 (a separate gloo world of that size each, one thread per rank, forked by
``megazero.testing.run_distributed``): megazero's ``TransformerLayer`` stack with sequence
parallelism, and the same model in plain ``nn`` modules parallelized with
``torch.distributed.tensor.parallel.parallelize_module`` (``SequenceParallel`` norms,
``PrepareModuleInput`` Shard(0) -> Replicate, ``ColwiseParallel`` Q/K/V and fc1,
``RowwiseParallel(output_layouts=Shard(0))`` dense and fc2). Both start from the same weights
(the peer is loaded from megazero's full state, its output checked against megazero's) and use
SDPA with ``is_causal=True``. Steps alternate between the two; the median over ``--steps`` is
reported with the ratio megazero / DTensor (target <= 1.0).

    PYTHONPATH=. .venv/bin/python bench/tensor_parallel.py [--layers 2 --hidden 256 --seq 256 --batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class PeerAttention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.d = h // heads
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.dense = nn.Linear(h, h)

    def forward(self, x):  # x: [s, b, h] replicated (local tensor)
        s, b = x.shape[:2]
        q, k, v = (lin(x) for lin in (self.q, self.k, self.v))  # local heads: [s, b, h/p]
        heads = q.shape[-1] // self.d
        q, k, v = (t.reshape(s, b, heads, self.d).permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, heads * self.d))


class PeerMLP(nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class PeerLayer(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.input_norm, self.post_attention_norm = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attention, self.mlp = PeerAttention(h, heads), PeerMLP(h, ffn)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


def _load_peer(peer: PeerLayer, full: dict, prefix: str, h: int):
    """Copy megazero's full tensors of one layer into the peer (fused QKV split into q, k, v)."""
    sd = {}
    for norm in ("input_norm", "post_attention_norm"):
        for kind in ("weight", "bias"):
            sd[f"{norm}.{kind}"] = full[f"{prefix}{norm}.{kind}"]
    for kind in ("weight", "bias"):
        for name, part in zip("qkv", full[f"{prefix}attention.qkv.{kind}"].split(h, 0)):
            sd[f"attention.{name}.{kind}"] = part
        sd[f"attention.dense.{kind}"] = full[f"{prefix}attention.dense.{kind}"]
        sd[f"mlp.fc1.{kind}"] = full[f"{prefix}mlp.fc1.{kind}"]
        sd[f"mlp.fc2.{kind}"] = full[f"{prefix}mlp.fc2.{kind}"]
    peer.load_state_dict(sd)


def _parallelize_peer(layers, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    plan = {
        "input_norm": SequenceParallel(sequence_dim=0, use_local_output=True),
        "attention": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.dense": RowwiseParallel(output_layouts=Shard(0)),
        "post_attention_norm": SequenceParallel(sequence_dim=0, use_local_output=True),
        "mlp": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(0)),
    }
    for layer in layers:
        parallelize_module(layer, mesh, plan)


def _bench(rank, world, a):
    from torch.distributed.device_mesh import DeviceMesh

    from megazero.model import GPTConfig
    from megazero.model.transformer import TransformerLayer
    from megazero.parallel.topology import Topology
    from megazero.tensor_parallel import RNGTracker

    topo = Topology(world, rank, tp=world).create_groups()
    config = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, vocab_size=128,
                       seq_length=a.seq, attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=True)
    rng = RNGTracker(config.seed, topo.tp_rank)
    ours = nn.ModuleList([TransformerLayer(config, n, topo.tp_group, rng, "cpu") for n in range(a.layers)])
    full = {}
    for n, layer in enumerate(ours):
        for mod_name, module in layer.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                t = module.local_to_full(p_name, p.detach()) if hasattr(module, "local_to_full") else p.detach()
                full[f"layers.{n}.{mod_name}.{p_name}"] = t
    peer = nn.ModuleList([PeerLayer(a.hidden, a.heads, config.ffn_hidden_size) for _ in range(a.layers)])
    for n, layer in enumerate(peer):
        _load_peer(layer, full, f"layers.{n}.", a.hidden)
    mesh = DeviceMesh("cpu", list(range(world)))
    _parallelize_peer(peer, mesh)

    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(a.seq, a.batch, a.hidden, generator=gen)
    g_full = torch.randn(a.seq, a.batch, a.hidden, generator=gen)
    x_local, g_local = x_full.chunk(world)[topo.tp_rank], g_full.chunk(world)[topo.tp_rank]

    def step(stack):
        x = x_local.clone().requires_grad_(True)
        for layer in stack:
            x = layer(x)
        x.backward(g_local)
        for p in stack.parameters():
            p.grad = None
        return x.detach()

    diff = (step(ours) - step(peer)).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    times = {"megazero": [], "dtensor": []}
    for i in range(a.warmup + a.steps):
        for name, stack in (("megazero", ours), ("dtensor", peer)):
            dist.barrier()
            t0 = time.perf_counter()
            step(stack)
            dist.barrier()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()} | {"max_diff": diff.item()}


def main(argv=None):
    from megazero.testing import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    a = p.parse_args(argv)
    print(f"GPT layer stack: {a.layers} layers, hidden {a.hidden}, heads {a.heads}, seq {a.seq}, batch {a.batch}, "
          f"fp32, CPU/gloo, sequence parallel; median of {a.steps} fwd+bwd steps")
    print(f"{'TP':>3} {'megazero ms':>12} {'DTensor ms':>11} {'ratio':>6} {'max |diff|':>11}")
    for tp in a.tp:
        r = run_distributed(_bench, tp, a, timeout_s=600)[0]
        print(f"{tp:>3} {r['megazero']:>12.1f} {r['dtensor']:>11.1f} {r['megazero'] / r['dtensor']:>6.2f} "
              f"{r['max_diff']:>11.2e}")


if __name__ == "__main__":
    main()
