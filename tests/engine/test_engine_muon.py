"""``megazero.initialize`` with DeepSpeed's ``"optimizer": {"type": "Muon"}`` block: a tiny random
GPT2LMHeadModel at ZeRO 0-3 x DP 2 (gradient accumulation 2, Hugging Face's two param groups) gives
the losses of one process stepping DeepSpeed's split (Muon on the >= 2-D parameters not named
embed/lm_head, AdamW on the rest) with ``optim.muon`` in DeepSpeed's ``gram`` arithmetic (fp32 on
this CPU: DeepSpeed's ``ns_compute_dtype``), every micro-batch within 1e-5. The peer suite checks
that arithmetic against DeepSpeed's own functions (tests/peers/test_deepspeed_muon.py)."""

import pytest
import torch

from megazero.optim.muon import MuonSettings, muon_step
from megazero.testing import run_distributed
from tests.engine.hf_tiny import MICRO, batches, build, engine_losses, groups

GAS, STEPS = 2, 3
PARAMS = {"lr": 2e-3, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-6}


def config(stage: int, **params) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "Muon", "params": dict(PARAMS, **params)}, "zero_optimization": zero}


def _worker(rank, world, stage, data):
    import megazero
    model = build("gpt2")
    engine, opt = megazero.initialize(model=model, model_parameters=groups(model), config=config(stage))[:2]
    assert any(g["use_muon"] for g in opt.param_groups)
    return engine_losses(engine, data, rank)


def _reference(data):
    """One process over both ranks' micro-batches: Muon (DeepSpeed's gram arithmetic) + AdamW."""
    model = build("gpt2")
    settings = MuonSettings(momentum=0.9, nesterov=True, flavour="deepspeed_gram", ns_dtype=None)
    muon, adam = [], []
    for g in groups(model):
        named = {id(p): n for n, p in model.named_parameters()}
        m = [p for p in g["params"] if p.dim() >= 2 and "embed" not in named[id(p)] and "lm_head" not in named[id(p)]]
        muon += [(p, g["weight_decay"]) for p in m]
        adam.append({"params": [p for p in g["params"] if all(p is not q for q in m)], "weight_decay": g["weight_decay"]})
    aw = torch.optim.AdamW([g for g in adam if g["params"]], lr=PARAMS["lr"], betas=(0.9, 0.95), eps=1e-6)
    bufs = [torch.zeros_like(p) for p, _ in muon]
    losses = [[[] for _ in range(STEPS)] for _ in range(2)]
    for it, step in enumerate(data):
        for r in range(2):
            for ids, labels in step[r]:
                loss = model(input_ids=ids, labels=labels).loss
                (loss / (2 * GAS)).backward()
                losses[r][it].append(loss.item())
        with torch.no_grad():
            for (p, wd), buf in zip(muon, bufs):
                muon_step([p], [p.grad], [buf], settings, lr=PARAMS["lr"], weight_decay=wd)
        aw.step()
        model.zero_grad()
    return [[v for it in range(STEPS) for v in losses[r][it]] for r in range(2)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_muon_equals_one_process(stage):
    data = batches("gpt2", STEPS, 2, GAS)
    ours = run_distributed(_worker, 2, stage, data, timeout_s=300)
    want = _reference(data)
    worst = max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(ours[r], want[r]))
    assert worst <= 1e-5, (stage, worst)
    assert want[0][-1] != want[0][GAS - 1]  # the model moved


def test_engine_muon_refusals():
    from megazero.config.engine_config import read_engine_config
    for params, extra, needle in [({"per_head_muon": True}, {}, "per_head_muon"),
                                  ({"ns_method": "svd"}, {}, "ns_method"),
                                  ({}, {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}, "gradient_clipping"),
                                  ({}, {"fp16": {"enabled": True}}, "fp16")]:
        cfg = dict(config(0, **params), **extra)
        with pytest.raises(ValueError, match=needle):
            read_engine_config(cfg, 1)


def _resume_worker(rank, world, path, data):
    import megazero
    out = []
    for part in ("first", "second"):
        model = build("gpt2")
        engine = megazero.initialize(model=model, model_parameters=groups(model), config=config(2))[0]
        steps = data[:2] if part == "first" else data[2:]
        if part == "second":
            engine.load_checkpoint(path, "t")
        for step in steps:
            for ids, labels in step[rank]:
                loss = engine(input_ids=ids, labels=labels).loss
                engine.backward(loss)
                engine.step()
                out.append(loss.item())
        if part == "first":
            engine.save_checkpoint(path, "t")
    return out


def test_engine_muon_checkpoint_resumes_exactly(tmp_path):
    """ZeRO 2, DP 2: two steps, save, a fresh engine loads and takes two more (the fourth's losses
    depend on the third's momentum): the losses of the uninterrupted run, bit for bit."""
    data = batches("gpt2", 4, 2, GAS)
    straight = run_distributed(_worker, 2, 2, data, timeout_s=300)
    resumed = run_distributed(_resume_worker, 2, str(tmp_path), data, timeout_s=300)
    assert resumed == straight
