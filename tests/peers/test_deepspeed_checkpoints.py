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
