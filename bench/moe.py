"""MoE on CPU/gloo: the token dispatchers (alltoall vs allgather) and the MoE layer vs a plain
PyTorch per-expert loop.

    PYTHONPATH=. .venv/bin/python bench/moe.py [--ep 2 4] [--seq 256 --batch 2 --hidden 256 --ffn 512
        --experts 8 --topk 2] [--reps 6 --warmup 2]

Two parts, each with its peers side by side in one run (steps alternate, so a shared box's load
falls on both), medians of ``--reps`` forward+backward steps of one MoE layer (fp32, dropless,
SwiGLU experts, one thread per rank):

* **dispatch** -- for each EP in ``--ep`` (a gloo world of EP ranks, TP 1, DP = EP, EDP 1), the
  same ``MoELayer`` weights with ``--moe-token-dispatcher-type alltoall`` and ``allgather``; each
  rank routes its own ``T = seq x batch`` tokens. Measured: step time (slowest rank), the rows
  each rank sends per direction (``MoELayer.stats["sent_rows"]``, mean over ranks) against the
  planner's formula (:func:`megazero.planner.expert_memory.dispatch_rows_per_direction`: ``T k
  (EP-1)/EP`` for alltoall under balanced routing, bound ``T k``; ``(EP-1) T`` for allgather),
  the bytes per layer forward+backward (4 x rows x hidden x 4 B), and the two dispatchers'
  output difference.
* **layer** -- one process: ``MoELayer`` (permute by expert, one matmul pair per expert,
  weighted un-permute) against a straightforward loop over experts on the same tokens and the
  same weights (router top-k, softmax over the k, ``x[idx] -> SwiGLU MLP -> index_add`` weighted);
  the max abs difference of the outputs and of the input gradients.

Prints a table and one JSON line per row (``"kind": "dispatch"`` / ``"layer"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def moe_config(a, dispatcher: str = "alltoall"):
    from megazero.model.config import GPTConfig
    return GPTConfig.from_megatron(dict(num_layers=1, hidden_size=a.hidden, num_attention_heads=4, seq_length=a.seq,
                                        add_bias_linear=False, swiglu=True, num_experts=a.experts,
                                        moe_ffn_hidden_size=a.ffn, moe_router_topk=a.topk,
                                        moe_token_dispatcher_type=dispatcher, hidden_dropout=0.0,
                                        attention_dropout=0.0), vocab_size=128)


def moe_layer(config, topo):
    from megazero.moe.layer import MoELayer, MoEState
    state = MoEState(config.num_layers, "cpu", config.moe.num_experts)
    return MoELayer(config, 0, topo, None, state, "cpu", "cpu")


def fwd_bwd(layer, x, g) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward+backward; (output, input gradient); parameter gradients dropped."""
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    y.backward(g)
    for p in layer.parameters():
        p.grad = None
    return y.detach(), x.grad


def timed(systems: dict, reps: int, warmup: int, sync=None) -> dict[str, float]:
    """Median ms per system, the systems' steps alternating; ``sync`` (a barrier) around each."""
    times = {name: [] for name in systems}
    for i in range(warmup + reps):
        for name, step in systems.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            step()
            if sync:
                sync()
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _dispatch(rank, world, a):
    from megazero.planner.expert_memory import dispatch_rows_per_direction
    from megazero.parallel.topology import Topology
    topo = Topology(world, rank, ep=world).create_groups()
    gen = torch.Generator().manual_seed(1000 + rank)
    x, g = torch.randn(a.seq, a.batch, a.hidden, generator=gen), torch.randn(a.seq, a.batch, a.hidden, generator=gen)
    layers = {d: moe_layer(moe_config(a, d), topo) for d in ("alltoall", "allgather")}
    outs = {d: fwd_bwd(layer, x, g)[0] for d, layer in layers.items()}
    diff = (outs["alltoall"] - outs["allgather"]).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    sent = torch.tensor([float(layers[d].stats["sent_rows"]) for d in layers])
    dist.all_reduce(sent)
    ms = timed({d: (lambda layer=layer: fwd_bwd(layer, x, g)) for d, layer in layers.items()}, a.reps, a.warmup,
               dist.barrier)
    T = a.seq * a.batch
    return [{"kind": "dispatch", "ep": world, "dispatcher": d, "tokens_per_rank": T, "median_ms": round(ms[d], 2),
             "sent_rows": sent[i].item() / world,
             "formula_rows": dispatch_rows_per_direction(moe_config(a, d), T, world),
             "bound_rows": T * a.topk if d == "alltoall" else (world - 1) * T,
             "mb_per_layer_fwd_bwd": round(4 * sent[i].item() / world * a.hidden * 4 / 1e6, 3),
             "max_diff_vs_other": diff.item()} for i, d in enumerate(layers)]


def per_expert_loop(x2d, router_w, experts, topk):
    """The reference: top-k of the router logits, softmax over the k, then per expert its tokens
    through a SwiGLU MLP, weighted and added back (plain PyTorch, no permutation machinery)."""
    top, idx = (x2d @ router_w.t()).topk(topk, dim=-1)
    probs = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x2d)
    for e, (w1, w2) in enumerate(experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x2d[tok], w1).chunk(2, dim=-1)
        out = out.index_add(0, tok, F.linear(F.silu(gate) * up, w2) * probs[tok, slot].unsqueeze(-1))
    return out


class Loop(torch.nn.Module):
    """:func:`per_expert_loop` holding its own copies of an ``MoELayer``'s weights."""

    def __init__(self, layer):
        super().__init__()
        self.topk = layer.moe.router_topk
        self.router = torch.nn.Parameter(layer.router.weight.detach().clone())
        self.w = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for m in layer.experts.values()
                                         for p in (m.fc1.weight, m.fc2.weight)])

    def forward(self, x):
        s, b, h = x.shape
        experts = [(self.w[2 * e], self.w[2 * e + 1]) for e in range(len(self.w) // 2)]
        return per_expert_loop(x.reshape(s * b, h), self.router, experts, self.topk).reshape(s, b, h), None


def layer_vs_loop(a) -> dict:
    torch.set_num_threads(a.threads)
    layer = moe_layer(moe_config(a), None)
    loop = Loop(layer)
    gen = torch.Generator().manual_seed(7)
    x, g = torch.randn(a.seq, a.batch, a.hidden, generator=gen), torch.randn(a.seq, a.batch, a.hidden, generator=gen)
    (y1, gx1), (y2, gx2) = fwd_bwd(layer, x, g), fwd_bwd(loop, x, g)
    ms = timed({"megazero": lambda: fwd_bwd(layer, x, g), "loop": lambda: fwd_bwd(loop, x, g)}, a.reps, a.warmup)
    return {"kind": "layer", "tokens": a.seq * a.batch, "megazero_ms": round(ms["megazero"], 2),
            "loop_ms": round(ms["loop"], 2), "ratio": round(ms["megazero"] / ms["loop"], 3),
            "max_diff_out": (y1 - y2).abs().max().item(), "max_diff_grad": (gx1 - gx2).abs().max().item()}


def main(argv=None):
    from megazero.testing import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="each expert's FFN size (--moe-ffn-hidden-size)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads of the one-process layer comparison")
    a = p.parse_args(argv)
    print(f"MoE layer: {a.experts} SwiGLU experts (FFN {a.ffn}), top-{a.topk}, hidden {a.hidden}, "
          f"{a.seq}x{a.batch} tokens per rank, fp32, dropless, CPU/gloo; median of {a.reps} fwd+bwd steps")
    print(f"{'EP':>3} {'dispatcher':>10} {'ms':>8} {'rows sent':>10} {'formula':>9} {'bound':>7} {'ratio':>6} "
          f"{'MB/layer':>9} {'max |diff|':>11}")
    for ep in a.ep:
        for r in run_distributed(_dispatch, ep, a, timeout_s=900)[0]:
            print(f"{ep:>3} {r['dispatcher']:>10} {r['median_ms']:>8.1f} {r['sent_rows']:>10.1f} "
                  f"{r['formula_rows']:>9.1f} {r['bound_rows']:>7} {r['sent_rows'] / r['formula_rows']:>6.3f} "
                  f"{r['mb_per_layer_fwd_bwd']:>9.3f} {r['max_diff_vs_other']:>11.2e}")
            print(json.dumps(r))
    r = layer_vs_loop(a)
    print(f"one process, {r['tokens']} tokens: MoELayer {r['megazero_ms']:.1f} ms, per-expert loop "
          f"{r['loop_ms']:.1f} ms, ratio {r['ratio']:.3f}; max |diff| output {r['max_diff_out']:.2e}, "
          f"input grad {r['max_diff_grad']:.2e}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
