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


FP16 = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 3, "hysteresis": 2}


def _fp16_run(rank, world, data, folder, stage):
    """fp16 with a dynamic scale (overflows, hysteresis, growth in 9 steps): 4 steps, save
    DeepSpeed's files, 5 more; a second engine loads and takes the same 5 steps."""
    import megazero
    from megazero.checkpoint.deepspeed_files import load_file

    def fresh():
        return megazero.initialize(model=_mlp(), config={**_cfg(stage, 2), "fp16": FP16})[0]

    def steps(engine, todo):
        out = []
        for step in todo:
            for x, y in step[rank]:
                out.append(((engine(x.half()).float() - y) ** 2).mean())
                engine.backward(out[-1])
                engine.step()
            out[-1] = (out[-1].item(), engine.loss_scale)
        return out[1::2], engine.skipped_steps
    engine = fresh()
    steps(engine, data[:4])
    scaler = engine.zero.scaler.state_dict()
    engine.save_checkpoint(folder, "t", format="deepspeed")
    record = load_file(os.path.join(folder, "t", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    record = record["optimizer_state_dict"]["loss_scaler"]
    want = steps(engine, data[4:])
    other = fresh()
    other.load_checkpoint(folder)
    return scaler, vars(record), other.zero.scaler.state_dict(), want, steps(other, data[4:])


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_dynamic_loss_scale_is_written_as_deepspeeds_scaler(stage, tmp_path):
    """DeepSpeed's ``DynamicLossScaler`` with the engine's scale, window, hysteresis and counters
    (deepspeed_writer.loss_scaler_record); read back into the engine's scaler, the run continues
    with the same losses, scales and skipped steps."""
    from megazero.checkpoint.deepspeed_files import scaler_state
    from megazero.checkpoint.deepspeed_writer import loss_scaler_record
    from megazero.zero.loss_scaler import DeepSpeedLossScaler
    for scaler, record, loaded, want, got in run_distributed(_fp16_run, 2, _data(2, 9), str(tmp_path), stage,
                                                              timeout_s=120):
        assert record["dynamic"] and record["cur_scale"] == scaler["scale"] and record["scale_window"] == 3
        assert record["delayed_shift"] == 2 and not record["consecutive_hysteresis"]
        assert {k: record[k] for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")} == \
            {k: scaler[k] for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")}
        assert loaded == scaler, (loaded, scaler)
        assert got == want, (got, want)
        assert want[1] > 0 and len({s for _, s in want[0]}) > 1  # the scale moved after the save
    for last in range(-1, 4):  # DeepSpeed's counters survive the round trip as they are
        s = DeepSpeedLossScaler(2.0 ** 10, window=4, hysteresis=3)
        s.cur_iter, s.last_overflow_iter, s.cur_hysteresis = 5, last, 2
        assert scaler_state(loss_scaler_record(s, 11), DeepSpeedLossScaler(window=4)) == s.state_dict()


def _frozen_run(rank, world, data, folder, stage, save):
    """``_mlp`` with its first bias frozen: save (DP 2) or load (the frozen bias zeroed first)."""
    import megazero
    from megazero.checkpoint.deepspeed_files import load_file
    model = _mlp()
    model[0].bias.requires_grad_(False)
    if save:
        with torch.no_grad():
            model[0].bias.mul_(3)
    else:
        torch.nn.init.zeros_(model[0].bias)
    engine = megazero.initialize(model=model, config=_cfg(stage, 2 * 2 // world))[0]
    if save:
        _run(engine, data[0][rank])
        engine.save_checkpoint(folder, "t", format="deepspeed")
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        states = load_file(os.path.join(folder, "t", name))
        return states["frozen_param_shapes"], states["frozen_param_fragments"], model[0].bias.detach().clone()
    engine.load_checkpoint(folder)
    return model[0].bias.detach().clone()


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_are_written_as_deepspeed_writes_them(stage, tmp_path):
    """``frozen_param_shapes`` and ``frozen_param_fragments`` (whole at ZeRO 2, rank r's padded
    ceil(8 / 2)-element piece at ZeRO 3); the engine reads them back at DP 1."""
    saved = run_distributed(_frozen_run, 2, _data(2, 1), str(tmp_path), stage, True, timeout_s=120)
    for rank, (shapes, pieces, bias) in enumerate(saved):
        assert list(shapes) == ["0.bias"] and list(shapes["0.bias"]) == [8] and list(pieces) == ["0.bias"]
        want = bias[rank * 4:(rank + 1) * 4] if stage == 3 else bias
        assert torch.equal(pieces["0.bias"], want), (rank, pieces, want)
    loaded = run_distributed(_frozen_run, 1, _data(2, 1), str(tmp_path), 3 if stage == 2 else 1, False,
                             timeout_s=120)[0]
    assert torch.equal(loaded, saved[0][2])
