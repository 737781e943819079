"""Shared helpers for the ZeRO tests: a small model, batches, a single-process reference."""

from __future__ import annotations

import torch
from torch import nn

from megazero.testing import run_distributed

D_IN, D, D_OUT = 8, 16, 4


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))


class Net(nn.Module):
    """input Linear -> ModuleList of residual MLP blocks -> LayerNorm -> head; MSE loss."""

    def __init__(self, layers=3, seed=0, d=D):
        super().__init__()
        g = torch.manual_seed(seed)
        del g
        self.inp = nn.Linear(D_IN, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, D_OUT)
        with torch.no_grad():  # non-trivial norm parameters
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.add_(torch.randn_like(m.weight) * 0.1)
                    m.bias.add_(torch.randn_like(m.bias) * 0.1)

    def forward(self, x, y):
        h = self.inp(x.to(self.inp.weight.dtype))
        for layer in self.layers:
            h = layer(h)
        out = self.head(self.norm(h)).float()
        return ((out - y) ** 2).mean()


def batches(steps, dp, M, mb=2, seed=1):
    """batches[step][dp_rank][micro] = (x, y)."""
    g = torch.Generator().manual_seed(seed)
    return [[[(torch.randn(mb, D_IN, generator=g), torch.randn(mb, D_OUT, generator=g)) for _ in range(M)]
             for _ in range(dp)] for _ in range(steps)]


def reference(data, *, lr=1e-2, wd=0.1, clip=0.0, layers=3, betas=(0.9, 0.95), optimizer=torch.optim.AdamW):
    """Single-process ``optimizer`` (torch.optim.AdamW; or torch.optim.Adam: L2 decay) on the
    global batches; returns the final parameters."""
    model = Net(layers)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = optimizer([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                    lr=lr, betas=betas, foreach=True)
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        for x, y in mbs:
            (model(x, y) / len(mbs)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train_zero(topo, data, *, stage, M, layers=3, lr=1e-2, wd=0.1, betas=(0.9, 0.95), model=None, hook=None,
               pre=None, **kw):
    """Train Net with ZeroOptimizer on this rank's share of ``data``; returns (params, opt, oks).

    ``pre(it, model, opt)`` runs before an iteration's micro-batches and may return a hook
    handle (removed after them); ``hook(it, model, opt)`` runs between backward and step.
    """
    from megazero.zero import ZeroOptimizer
    model = model or Net(layers)
    opt = ZeroOptimizer(model, topo, stage=stage, num_micro_batches=M, lr=lr, weight_decay=wd, betas=betas, **kw)
    oks = []
    for it, step in enumerate(data):
        handle = pre(it, model, opt) if pre is not None else None
        for k, (x, y) in enumerate(step[topo.dp_rank]):
            loss = model(x, y)
            loss.backward(opt.loss_scale / M)
        if handle is not None:
            handle.remove()
        opt.finish_grad_sync()
        if hook is not None:
            hook(it, model, opt)
        oks.append(opt.step())
    with opt.gathered_params():
        params = [p.detach().float().clone() for p in model.parameters()]
    return params, opt, oks


def launch(fn, world_size, *args, **kwargs):
    """run_distributed with a 30 s collective timeout (a stuck collective fails fast)."""
    return run_distributed(fn, world_size, *args, collective_timeout_s=30, **kwargs)


def max_rel(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))
