"""Default stage-3 units of a model without a ModuleList (megazero.engine.units): an
nn.Sequential of blocks is partitioned one block per unit, and trains at ZeRO-3 over DP 2 as
one process with torch.optim.AdamW."""

from __future__ import annotations

import torch
from torch import nn

from megazero.engine.units import default_units
from megazero.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}


def net():
    torch.manual_seed(4)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(nn.Embedding(50, 16), *blocks, nn.Linear(16, 50))


def test_sequential_blocks_are_units():
    m = net()
    assert default_units(m) == [list(m.children())]  # embedding, 4 blocks, head (each >= 1/32)
    wrapped = nn.Sequential(m, nn.Linear(50, 2))
    assert default_units(wrapped) == [list(m.children())]  # descended into; the small head stays in the root


def _train(rank, world, data):
    import megazero
    engine, *_ = megazero.initialize(model=net(), config=CFG)
    assert len(engine.zero.gatherer.units) == 6
    losses = []
    for step in data:
        for ids in step[rank]:
            loss = nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def test_sequential_model_zero3_dp2_equals_one_process():
    g = torch.Generator().manual_seed(2)
    data = [[[torch.randint(0, 50, (2, 6), generator=g) for _ in range(2)] for _ in range(2)] for _ in range(3)]
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    want = []
    for step in data:
        for rank in step:
            for ids in rank:
                loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                (loss / 4).backward()
                want.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(run_distributed(_train, 2, data, timeout_s=120)):
        mine = [want[s * 4 + rank * 2 + m] for s in range(3) for m in range(2)]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, mine)), (got, mine)
