"""A model built on the meta device and materialized by ZeRO region by region (DeepSpeed's
``zero.Init`` role): at ZeRO-3 over DP 2 it trains as the same model built whole in one process,
and no rank ever held more than one unit's full parameters while building."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from megazero.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.out = nn.Linear(16, 1)
        self.register_buffer("shift", torch.full((16,), 0.5))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x + self.shift))
        return self.out(x).square().mean()


def draw(name: str, p) -> torch.Tensor:
    """Each parameter from a generator seeded by its name (the same on every rank and layout)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(p.shape, generator=g) * 0.3


def _meta(rank, world, xs):
    import megazero
    with torch.device("meta"):
        model = Net()
    model.register_buffer("shift", torch.full((16,), 0.5))  # buffers on a real device
    engine, *_ = megazero.initialize(model=model, config=CFG, param_init=draw)
    unit = max(u.region.padded for u in engine.zero.gatherer.units) * 4
    assert engine.zero.build_peak_unit_bytes <= unit
    losses = []
    for x in xs:
        loss = engine(x[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_meta_model_materialized_by_unit_equals_one_process():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 2, 16, generator=g) for _ in range(3)]
    model = Net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw(name, p))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for x in xs:
        losses = [model(x[r]) for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        want.append([v.item() for v in losses])
    for rank, got in enumerate(run_distributed(_meta, 2, xs, timeout_s=120)):
        assert all(abs(a - w[rank]) <= 1e-5 * abs(w[rank]) for a, w in zip(got, want)), (got, want)


def _no_init(rank, world):
    import megazero
    with torch.device("meta"):
        model = Net()
    try:
        megazero.initialize(model=model, config=CFG)
    except ValueError as e:
        return str(e)


def test_meta_model_without_param_init_is_one_line():
    msg, = run_distributed(_no_init, 1, timeout_s=60)
    assert "parameter 'layers.0.weight' is on the meta device; pass param_init" in msg
