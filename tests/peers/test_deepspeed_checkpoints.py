"""DeepSpeed 0.19.8's checkpoint files and ``megazero.initialize``'s engine (issue 45 item 3).

DeepSpeed (CPU accelerator, gloo, DP 2) trains the tiny GPT2LMHeadModel of the engine tests
(tied LM head, Hugging Face's two param groups, AdamW, clipping, WarmupDecayLR) for 2 optimizer
steps at ZeRO 1, 2 or 3, saves with ``save_checkpoint`` and trains 2 more steps. megazero's
engine loads DeepSpeed's folder with ``load_checkpoint`` at DP 2 (the same stage) and at DP 1
(another stage, GAS 4 so the global batch is the same) and trains the same 2 steps: every
micro-batch loss equals DeepSpeed's continued run within 1e-5 (relative), and the client state,
step counters come back. The other direction: megazero saves with ``format="deepspeed"``;
DeepSpeed's ``zero_to_fp32`` recovers its fp32 weights exactly and ``deepspeed.initialize(...)
.load_checkpoint`` continues with megazero's losses. Each also with a 5-7-2 MLP whose param
groups (49 and 9 elements) exercise DeepSpeed's padding (the last rank's short partition at ZeRO
1/2, ceil-sized pieces at ZeRO 3)."""

import os
import warnings

import pytest
import torch

from bench.engine_equivalence import config
from tests.engine.hf_tiny import batches, build, groups

KINDS = ["gpt2", "odd"]

TOL, GAS, SAVED, MORE = 1e-5, 2, 2, 2


def ds_config(stage, system, gas=GAS):
    cfg = config(stage, system)
    cfg["gradient_accumulation_steps"] = gas
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 2, "total_num_steps": 8}}
    return cfg


def _model(kind):
    if kind == "gpt2":
        return build("gpt2")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _data(kind):
    if kind == "gpt2":
        return batches("gpt2", SAVED + MORE, 2, GAS)
    g = torch.Generator().manual_seed(3)
    return [[[(torch.randn(2, 5, generator=g), torch.randn(2, 2, generator=g)) for _ in range(GAS)]
             for _ in range(2)] for _ in range(SAVED + MORE)]


def _train(engine, steps, micro_of):
    out = []
    for step in steps:
        for a, b in micro_of(step):
            loss = engine(input_ids=a, labels=b).loss if a.dtype == torch.long else ((engine(a) - b) ** 2).mean()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
    return out


def deepspeed_worker(rank, world, kind, stage, data, folder):
    """Train SAVED steps, save, train MORE steps: the losses after the save."""
    warnings.filterwarnings("ignore")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(kind)
    engine = deepspeed.initialize(model=model, model_parameters=groups(model), config=ds_config(stage, "deepspeed"))[0]
    _train(engine, data[:SAVED], lambda step: step[rank])
    engine.save_checkpoint(folder, client_state={"epoch": 7})
    return _train(engine, data[SAVED:], lambda step: step[rank])


def megazero_worker(rank, world, kind, stage, data, folder):
    """Load DeepSpeed's folder at DP ``world`` (GAS keeps the global batch) and train MORE steps."""
    warnings.filterwarnings("ignore")
    import megazero
    model = _model(kind)
    gas = GAS * 2 // world
    engine = megazero.initialize(model=model, model_parameters=groups(model),
                                 config=ds_config(stage, "megazero", gas))[0]
    _, client = engine.load_checkpoint(folder)
    state = (client, engine.global_steps, engine.global_samples, engine.get_lr())
    losses = _train(engine, data[SAVED:], lambda step: step[rank] if world == 2 else step[0] + step[1])
    return state, losses


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_megazero_engine_continues_deepspeeds_checkpoint(stage, kind, tmp_path, deepspeed_ranks):
    data = _data(kind)
    folder = str(tmp_path / "ds")
    theirs = deepspeed_ranks(deepspeed_worker, 2, kind, stage, data, folder, timeout_s=600)
    assert sorted(os.listdir(os.path.join(folder, f"global_step{SAVED}")))
    for world, our_stage in ((2, stage), (1, 3 if stage < 3 else 1)):
        ours = deepspeed_ranks(megazero_worker, world, kind, our_stage, data, folder, timeout_s=600)
        client, steps, samples, lr = ours[0][0]
        assert client.get("epoch") == 7 and steps == SAVED and samples == SAVED * GAS * 2 * 2, ours[0][0]
        want = [theirs[0], theirs[1]] if world == 2 else [[v for s in range(MORE) for r in range(2)
                                                           for v in theirs[r][s * GAS:(s + 1) * GAS]]]
        got = [losses for _, losses in ours]
        worst = max(abs(a - b) / abs(b) for g, w in zip(got, want) for a, b in zip(g, w))
        assert [len(g) for g in got] == [len(w) for w in want] and worst <= TOL, (stage, world, worst, got, want)


def megazero_saving_worker(rank, world, kind, stage, data, folder):
    """megazero trains SAVED steps, saves DeepSpeed's files, trains MORE: (fp32 weights at the
    save, the losses after it)."""
    warnings.filterwarnings("ignore")
    import megazero
    model = _model(kind)
    engine = megazero.initialize(model=model, model_parameters=groups(model), config=ds_config(stage, "megazero"))[0]
    _train(engine, data[:SAVED], lambda step: step[rank])
    engine.save_checkpoint(folder, client_state={"epoch": 7}, format="deepspeed")
    weights = engine.module_state_dict()
    return weights, _train(engine, data[SAVED:], lambda step: step[rank])


def deepspeed_loading_worker(rank, world, kind, stage, data, folder):
    """DeepSpeed loads megazero's DeepSpeed-layout folder and trains MORE steps."""
    warnings.filterwarnings("ignore")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(kind)
    engine = deepspeed.initialize(model=model, model_parameters=groups(model), config=ds_config(stage, "deepspeed"))[0]
    _, client = engine.load_checkpoint(folder)
    state = (client.get("epoch"), engine.global_steps, engine.global_samples)
    return state, _train(engine, data[SAVED:], lambda step: step[rank])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_reads_megazero_engines_deepspeed_files(stage, kind, tmp_path, deepspeed_ranks):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    data = _data(kind)
    folder = str(tmp_path / "mz")
    ours = deepspeed_ranks(megazero_saving_worker, 2, kind, stage, data, folder, timeout_s=600)
    weights = ours[0][0]
    recovered = get_fp32_state_dict_from_zero_checkpoint(folder)
    params = dict(_model(kind).named_parameters(remove_duplicate=False))
    assert set(recovered) >= set(params)
    for name in params:
        assert torch.equal(recovered[name], weights[name]), name
    theirs = deepspeed_ranks(deepspeed_loading_worker, 2, kind, stage, data, folder, timeout_s=600)
    assert all(state == (7, SAVED, SAVED * GAS * 2 * 2) for state, _ in theirs), theirs
    worst = max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(theirs[r][1], ours[r][1]))
    assert worst <= TOL, (stage, worst, theirs, ours)


def fp16(power: int) -> dict:
    """A dynamic fp16 scale from ``2 ** power``, window 2, hysteresis 2."""
    return {"enabled": True, "initial_scale_power": power, "loss_scale_window": 2, "hysteresis": 2}


def _fp16_train(engine, steps, micro_of, scale_of):
    """fp16 micro-batches of the 5-7-2 MLP: (losses, the loss scale after each optimizer step)."""
    losses, scales = [], []
    for step in steps:
        for a, b in micro_of(step):
            loss = ((engine(a).float() - b) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        scales.append(scale_of(engine))
    return losses, scales


def _frozen_odd():
    model = _model("odd")
    model[0].bias.requires_grad_(False)
    with torch.no_grad():
        model[0].bias.mul_(3)
    return model


def megazero_fp16_saving_worker(rank, world, stage, data, folder, frozen, power):
    """megazero (fp16, dynamic scale; or fp32 with a frozen bias) trains SAVED steps, saves
    DeepSpeed's files, trains MORE."""
    warnings.filterwarnings("ignore")
    import megazero
    model = _frozen_odd() if frozen else _model("odd")
    cfg = ds_config(stage, "megazero") if frozen else {**ds_config(stage, "megazero"), "fp16": fp16(power)}
    engine = megazero.initialize(model=model, model_parameters=groups(model), config=cfg)[0]
    cast = (lambda t: t) if frozen else (lambda t: t.half())
    micro = lambda step: [(cast(a), b) for a, b in step[rank]]  # noqa: E731
    _fp16_train(engine, data[:SAVED], micro, lambda e: e.loss_scale)
    engine.save_checkpoint(folder, format="deepspeed")
    at_save = engine.loss_scale
    return _fp16_train(engine, data[SAVED:], micro, lambda e: e.loss_scale), engine.skipped_steps, at_save


def deepspeed_fp16_loading_worker(rank, world, stage, data, folder, frozen, power):
    """DeepSpeed loads the folder and trains MORE steps. Test-only shim: DeepSpeed's CPU
    accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels (torch's CPU fp16 ops
    work), so ``is_fp16_supported`` is made to say True in this forked rank."""
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    model = _frozen_odd() if frozen else _model("odd")
    if frozen:
        torch.nn.init.zeros_(model[0].bias)  # must come back from the checkpoint
    cfg = ds_config(stage, "deepspeed") if frozen else {**ds_config(stage, "deepspeed"), "fp16": fp16(power)}
    engine = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)[0]
    engine.load_checkpoint(folder)
    cast = (lambda t: t) if frozen else (lambda t: t.half())
    micro = lambda step: [(cast(a), b) for a, b in step[rank]]  # noqa: E731
    out = _fp16_train(engine, data[SAVED:], micro, lambda e: e.optimizer.loss_scale)
    with deepspeed.zero.GatheredParameters([model[0].bias], enabled=stage == 3):  # ZeRO 3: partitioned
        return out, engine.skipped_steps, model[0].bias.detach().float().clone()


@pytest.mark.parametrize("kind,stage,power", [("fp16", 1, 18), ("fp16", 2, 19), ("fp16", 3, 12),
                                              ("frozen", 2, None), ("frozen", 3, None)])
def test_deepspeed_continues_megazero_fp16_and_frozen(kind, stage, power, tmp_path, deepspeed_ranks):
    """fp16 with a dynamic loss scale (window 2, hysteresis 2), the save falling after overflows
    that spent the hysteresis (2 ** 18, 2 ** 19: the next overflow backs off at once) or between
    growths (2 ** 12: a growth due one step after the save): DeepSpeed takes the engine's scaler
    (its DynamicLossScaler) and continues with its losses, scales and skipped-step count. (Scales
    where the two engines already differ without a checkpoint -- whether a step overflows near
    2 ** 16 -- are left out; the growth rule is the same: tests/peers/test_deepspeed_loss_scaler.py.)
    A frozen bias: DeepSpeed restores it from the files (``frozen_param_fragments``) and
    ``zero_to_fp32`` recovers it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    frozen = kind == "frozen"
    data, folder = _data("odd"), str(tmp_path / "mz")
    ours = deepspeed_ranks(megazero_fp16_saving_worker, 2, stage, data, folder, frozen, power, timeout_s=600)
    theirs = deepspeed_ranks(deepspeed_fp16_loading_worker, 2, stage, data, folder, frozen, power, timeout_s=600)
    for (got, skipped, bias), (want, want_skipped, _) in zip(theirs, ours):
        assert got[1] == want[1] and skipped == want_skipped, (got, want, skipped, want_skipped)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
        assert worst <= TOL, (kind, worst, got, want)
        if frozen:
            assert torch.equal(bias, _frozen_odd()[0].bias.detach()), bias
    if frozen:
        recovered = get_fp32_state_dict_from_zero_checkpoint(folder)
        assert torch.equal(recovered["0.bias"], _frozen_odd()[0].bias.detach())
    else:
        assert ours[0][0][1][-1] != ours[0][2], ours[0]  # the scale moved after the save
