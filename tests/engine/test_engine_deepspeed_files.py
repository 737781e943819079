"""DeepSpeed 0.19.8's checkpoint layout from and into ``megazero.initialize``'s engine, without
DeepSpeed installed (the peer suite checks the files against DeepSpeed itself:
tests/peers/test_deepspeed_checkpoints.py).

``save_checkpoint(format="deepspeed")`` at ZeRO 1/2/3 over DP 2 (two param groups, a 67-element
model: DeepSpeed's padding and the last rank's short partition) writes DeepSpeed's file names and
keys; ``load_checkpoint`` reads them back at DP 2 and at DP 1 with another stage and continues
with the losses of the run that saved. A damaged or mismatched folder is refused in one line
naming the file and the cause, and nothing is written into it."""

from __future__ import annotations

import os

import pytest
import torch

from megazero.testing import run_distributed

from .test_engine_api import _data, _mlp
from .test_engine_checkpoint import _cfg, _run

STEPS = 3


def _engine(stage, gas, width=8):
    import megazero
    model = _mlp(width)
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.1},
              {"params": list(model[2].parameters()), "weight_decay": 0.0}]
    return megazero.initialize(model=model, model_parameters=groups, config=_cfg(stage, gas))[0]


def _losses(engine, micro):
    out = []
    for x, y in micro:
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _save(rank, world, stage, data, folder):
    engine = _engine(stage, 2)
    for step in data[:2]:
        _run(engine, step[rank])
    engine.save_checkpoint(folder, client_state={"epoch": 7}, format="deepspeed")
    return _losses(engine, data[2][rank])


def _load(rank, world, stage, data, folder, width=8):
    engine = _engine(stage, 2 * 2 // world, width)
    _, client = engine.load_checkpoint(folder)
    micro = data[2][rank] if world == 2 else data[2][0] + data[2][1]
    return client, engine.global_steps, _losses(engine, micro)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_files_round_trip_at_another_dp_size_and_stage(stage, tmp_path):
    data, folder = _data(2, STEPS), str(tmp_path / "ds")
    saved = run_distributed(_save, 2, stage, data, folder, timeout_s=120)
    assert sorted(os.listdir(folder)) == ["global_step2", "latest"]
    files = sorted(os.listdir(os.path.join(folder, "global_step2")))
    model = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)] if stage == 3
             else ["mp_rank_00_model_states.pt"])
    assert files == sorted(model + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)])
    for world, other in ((2, stage), (1, 3 if stage < 3 else 1)):
        got = run_distributed(_load, world, other, data, folder, timeout_s=120)
        assert all(client == {"epoch": 7} and steps == 2 for client, steps, _ in got)
        want = saved if world == 2 else [saved[0] + saved[1]]
        for (_, _, losses), ref in zip(got, want):
            assert losses == pytest.approx(ref, rel=1e-6, abs=0), (stage, world, losses, ref)


def _load_error(rank, world, folder, width):
    from megazero.checkpoint import CheckpointError
    engine = _engine(2, 4, width)
    try:
        engine.load_checkpoint(folder)
    except (CheckpointError, ValueError) as e:
        return str(e)
    return None


def _snapshot(folder):
    return {name: open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def test_a_damaged_or_mismatched_deepspeed_folder_is_refused_in_one_line(tmp_path):
    data, folder = _data(2, STEPS), str(tmp_path / "ds")
    run_distributed(_save, 2, 2, data, folder, timeout_s=120)
    tag = os.path.join(folder, "global_step2")
    optim1 = os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    model = os.path.join(tag, "mp_rank_00_model_states.pt")

    def refused(width=8):
        before = _snapshot(folder)
        message = run_distributed(_load_error, 1, folder, width, timeout_s=120)[0]
        assert message is not None and "\n" not in message, message
        assert _snapshot(folder) == before  # nothing written into the source folder
        return message

    message = refused(width=6)  # another model
    assert model in message and "holds another model" in message and "'0.bias'" in message, message
    states = torch.load(model, weights_only=True)
    torch.save({**states, "dp_world_size": 1}, model)
    message = refused()
    assert os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt") in message
    assert "partitioned over 2 ranks" in message and "dp_world_size 1" in message, message
    optim0 = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.rename(optim0, optim0 + ".away")
    torch.save({**states, "optimizer": {"state": {}}}, model)  # DeepSpeed without ZeRO
    message = refused()
    assert model in message and "saved without ZeRO" in message, message
    os.rename(optim0 + ".away", optim0)
    torch.save(states, model)
    whole = open(optim1, "rb").read()
    with open(optim1, "wb") as f:
        f.write(whole[: len(whole) // 2])
    message = refused()
    assert optim1 in message and "cannot be read" in message, message
    os.remove(optim1)
    message = refused()
    assert message == f"engine.load_checkpoint: {optim1} is missing", message


def _save_then_fail(rank, world, data, folder):
    from megazero.checkpoint import CheckpointError
    engine = _engine(2, 2)
    _run(engine, data[0][rank])
    engine.save_checkpoint(folder, "good", format="deepspeed")
    _run(engine, data[1][rank])
    try:  # rank 0's client state cannot be pickled: its model-states write fails
        engine.save_checkpoint(folder, "bad", client_state={"f": (lambda: 0) if rank == 0 else 0}, format="deepspeed")
    except CheckpointError as e:
        return str(e)
    return None


def test_a_failed_deepspeed_layout_save_keeps_the_previous_checkpoint(tmp_path):
    for failed in run_distributed(_save_then_fail, 2, _data(2, STEPS), str(tmp_path), timeout_s=120):
        assert failed is not None and "rank 0:" in failed and "mp_rank_00_model_states.pt" in failed, failed
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]  # no tmp or scratch folder left
    assert (tmp_path / "latest").read_text() == "good"


def _bf16_round_trip(rank, world, data, folder):
    import megazero
    cfg = {**_cfg(2, 2), "bf16": {"enabled": True}}
    engine = megazero.initialize(model=_mlp(), config=cfg)[0]
    for x, y in data[0][rank]:
        engine.backward(((engine(x.bfloat16()).float() - y) ** 2).mean())
        engine.step()
    engine.save_checkpoint(folder, "t", format="deepspeed")
    files = sorted(os.listdir(os.path.join(folder, "t")))
    other = megazero.initialize(model=_mlp(), config=cfg)[0]
    other.load_checkpoint(folder)
    same = all(torch.equal(a, b) for a, b in zip(engine.module_state_dict().values(),
                                                 other.module_state_dict().values()))
    return files, same


def test_a_bf16_engine_writes_deepspeeds_bf16_names(tmp_path):
    files, same = run_distributed(_bf16_round_trip, 2, _data(2, 1), str(tmp_path), timeout_s=120)[0]
    assert files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)] + [
        "mp_rank_00_model_states.pt"] and same, files
