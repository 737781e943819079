"""fp16 through megazero.initialize (DP 2, ZeRO-2): the config's dynamic loss scaler skips the
steps whose scaled gradients overflow (DeepSpeed: ``skipped_steps``, no scheduler step, scale
halved), then trains; bf16 trains close to fp32."""

from __future__ import annotations

import torch
from torch import nn

from megazero.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _cfg(precision: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2,
                                                          "warmup_type": "linear"}},
            "zero_optimization": {"stage": 2}}


def _run(rank, world, precision, steps):
    import megazero
    engine, *_ = megazero.initialize(model=_net(), config=_cfg(precision))
    g = torch.Generator().manual_seed(rank)
    dtype = next(engine.module.parameters()).dtype
    scales, lrs, losses = [], [], []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g).to(dtype)
        loss = engine(x).float().square().mean()
        scales.append(engine.loss_scale)
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
        losses.append(loss.item())
    return scales, lrs, losses, engine.skipped_steps, engine.global_steps, str(dtype)


def test_fp16_overflow_skips_and_bf16_follows_fp32():
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 1000, "hysteresis": 1}}
    scales, lrs, losses, skipped, steps, dtype = run_distributed(_run, 2, fp16, 8, timeout_s=120)[0]
    assert dtype == "torch.float16" and steps == 8 and 1 <= skipped <= 5, skipped
    assert scales[1] == scales[0] / 2 and lrs[0] == 0.0  # overflow: scale halved, the schedule did not move
    assert lrs[-1] > 0 and all(x == x for x in losses)  # after the skips it steps
    ref = run_distributed(_run, 2, {}, 6, timeout_s=120)[0][2]
    bf16 = run_distributed(_run, 2, {"bf16": {"enabled": True}}, 6, timeout_s=120)[0]
    assert bf16[5] == "torch.bfloat16" and bf16[3] == 0
    assert max(abs(a - b) / abs(b) for a, b in zip(bf16[2], ref)) < 5e-2
