"""Engine checkpoints: saved at ZeRO-3 over DP 2 after two steps, loaded at ZeRO-2 over DP 1
(twice the accumulation, the same global batch) and at ZeRO-3 over DP 2, the next step gives the
uninterrupted run's weights; the consolidated fp32 state dict equals the gathered module's."""

from __future__ import annotations

import torch

from megazero.testing import run_distributed

from .test_engine_api import _data, _mlp


def _cfg(stage, gas):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _run(engine, micro):
    for x, y in micro:
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()


def _save(rank, world, data, folder):
    import megazero
    engine, *_ = megazero.initialize(model=_mlp(), config=_cfg(3, 2), zero_units=["0", "2"])
    for step in data[:2]:
        _run(engine, step[rank])
    engine.save_checkpoint(folder, "t2", client_state={"note": 7})
    at_save = engine.module_state_dict()
    _run(engine, data[2][rank])
    return at_save, engine.module_state_dict()


def _resume(rank, world, data, folder, stage):
    import megazero
    gas = 4 // world
    engine, *_ = megazero.initialize(model=_mlp(), config=_cfg(stage, gas))
    path, client = engine.load_checkpoint(folder)
    assert client == {"note": 7} and engine.global_steps == 2 and path.endswith("t2")
    per = 2 // world  # saved-run ranks whose micro-batches this rank takes
    _run(engine, [mb for r in range(rank * per, (rank + 1) * per) for mb in data[2][r]])
    return engine.module_state_dict()


def test_save_dp2_zero3_load_dp1_zero2_and_dp2_zero3(tmp_path):
    from megazero.checkpoint.engine import consolidated_state_dict
    data = _data(2)
    at_save, want = run_distributed(_save, 2, data, str(tmp_path), timeout_s=120)[0]
    full = consolidated_state_dict(str(tmp_path), "t2")
    assert set(full) == set(at_save) and all(torch.equal(full[k], v) for k, v in at_save.items())
    for world, stage in ((1, 2), (2, 3)):
        for got in run_distributed(_resume, world, data, str(tmp_path), stage, timeout_s=120):
            for k, v in want.items():
                assert (got[k] - v).abs().max() <= 1e-6 * v.abs().max(), (world, stage, k)
