"""Engine save/load across DP sizes and gradient accumulation, judged by the losses of the steps
after the load (issue 41, item 1).

A tiny ``RobertaForMaskedLM`` (fp32, no dropout, AdamW, clipping) trains 3 steps of a fixed
global batch of 4 micro-batches of ``MICRO`` rows (the same rows at every layout: DP rank ``r`` of
``dp`` takes micro-batches ``[r * gas, (r + 1) * gas)``), saves, and trains 3 more; another
launch at the other layout loads the checkpoint and trains the same 3 steps. Step ``s``'s loss is
the mean of its 4 micro-batch losses (over DP ranks and accumulation). The resumed run's steps
4-6 must equal the uninterrupted run's within ``TOL``, at ZeRO stages 0-3, for DP 2 / GAS 2 ->
DP 1 / GAS 4 and DP 1 / GAS 4 -> DP 2 / GAS 2. Saving after 3 steps makes the saved micro-step
count (3 * GAS) no multiple of the other layout's GAS, so a boundary that followed the saved
counter would step after 2 (or 1) micro-batches instead of the new GAS.

Three launches: DP 2 saves and continues (A); DP 1 loads A and saves and continues (B); DP 2
loads B.
"""

from __future__ import annotations

import pytest

import megazero
from megazero.testing import run_distributed

from .hf_tiny import BETAS, EPS, LR, MICRO, batches, build, groups

# resolved here, once: the forked ranks inherit the module instead of each importing it (seconds)
pytest.importorskip("transformers").RobertaForMaskedLM
STAGES, SAVED, AFTER, MICROS, TOL = (0, 1, 2, 3), 3, 3, 4, 1e-6


def _config(stage: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(engine, rank, steps):
    """This rank's micro-batch losses of ``steps`` (``data[step][0]``, the 4 micro-batches)."""
    gas = engine.gradient_accumulation_steps()
    out = []
    for step in steps:
        row = []
        for ids, labels in step[0][rank * gas:(rank + 1) * gas]:
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            row.append(loss.item())
        out.append(row)
    return out


def _engine(stage, world):
    model = build("roberta")
    engine, *_ = megazero.initialize(model=model, model_parameters=groups(model),
                                     config=_config(stage, MICROS // world))
    return engine


def _save_and_continue(rank, world, data, folder):
    """Per stage: steps 1-3, save, steps 4-6 -> losses of steps 4-6."""
    out = {}
    for stage in STAGES:
        engine = _engine(stage, world)
        _train(engine, rank, data[:SAVED])
        engine.save_checkpoint(f"{folder}/s{stage}", "t")
        out[stage] = _train(engine, rank, data[SAVED:])
        engine.destroy()
    return out


def _load_and_continue(rank, world, data, folder):
    """Per stage: load, steps 4-6 -> (losses, global_steps and micro_steps right after the load)."""
    out = {}
    for stage in STAGES:
        engine = _engine(stage, world)
        engine.load_checkpoint(f"{folder}/s{stage}", "t")
        counters = (engine.global_steps, engine.micro_steps)
        out[stage] = (_train(engine, rank, data[SAVED:]), counters)
        engine.destroy()
    return out


def _resume_dp1(rank, world, data, folder_a, folder_b):
    return _load_and_continue(rank, world, data, folder_a), _save_and_continue(rank, world, data, folder_b)


def _step_means(per_rank: list) -> list[float]:
    """Per step, the mean of every rank's micro-batch losses (ranks hold equal counts)."""
    return [sum(sum(r[s]) for r in per_rank) / MICROS for s in range(len(per_rank[0]))]


def _check(saved: list, resumed: list, world: int, what: str) -> None:
    for stage in STAGES:
        want = _step_means([r[stage] for r in saved])
        got = _step_means([r[stage][0] for r in resumed])
        for s, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= TOL, f"{what} stage {stage} step {SAVED + 1 + s}: {g:.7f} vs uninterrupted {w:.7f}"
        for rank_out in resumed:
            assert rank_out[stage][1] == (SAVED, SAVED * MICROS // world), (what, stage, rank_out[stage][1])


def test_resume_across_dp_and_gas_continues_the_losses(tmp_path):
    data = batches("roberta", SAVED + AFTER, 1, MICROS)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved_a = run_distributed(_save_and_continue, 2, data, a, timeout_s=240)
    [(resumed_a, saved_b)] = run_distributed(_resume_dp1, 1, data, a, b, timeout_s=240)
    resumed_b = run_distributed(_load_and_continue, 2, data, b, timeout_s=240)
    _check(saved_a, [resumed_a], 1, "DP 2 / GAS 2 -> DP 1 / GAS 4")
    _check([saved_b], resumed_b, 2, "DP 1 / GAS 4 -> DP 2 / GAS 2")
