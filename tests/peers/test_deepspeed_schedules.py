"""DeepSpeed 0.19.8's own LR scheduler classes (deepspeed/runtime/lr_schedules.py, built as its
engine builds them: ``cls(optimizer, **scheduler.params)``) against megazero's reading of the same
ds_config (``parse_args --deepspeed-config`` -> ``build_lr_scheduler``): every type megazero accepts,
its defaults and edges, give DeepSpeed's LR after every optimizer step, and what DeepSpeed refuses
megazero refuses."""

import json

import pytest
import torch
from deepspeed.runtime import lr_schedules

from megazero.arguments import parse_args
from megazero.config.run_config import lr_config
from megazero.optim.lr_schedule import build_lr_scheduler

SHAPE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"]
OPT_LR = 0.02  # optimizer.params.lr: the optimizer's lr DeepSpeed's schedulers see
STEPS = 40

CASES = [
    ("WarmupLR", {}),  # warmup_max_lr None -> the optimizer's lr (0.19.8)
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.5, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 7}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),  # max 0.001
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5, "warmup_max_lr": 0.1}),  # total < warmup
    ("WarmupDecayLR", {"total_num_steps": 0, "warmup_num_steps": 2, "warmup_max_lr": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.2, "warmup_type": "linear"}),  # clamped past total
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 5}),  # total <= warmup: accepted
    ("WarmupCosineLR", {"total_num_steps": 12}),  # warmup default 1000: never leaves warm-up here
]


def config(kind, params):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": OPT_LR}},
            "scheduler": {"type": kind, "params": params}}


def megazero_args(tmp_path, kind, params):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(kind, params)))
    return parse_args(["--deepspeed-config", str(path), *SHAPE], world_size=1, prog="pretrain_gpt.py")


def deepspeed_lrs(kind, params):
    """The optimizer's lr after n = 0..STEPS scheduler steps (the engine steps it after each
    applied optimizer step)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=OPT_LR)
    sched = getattr(lr_schedules, kind)(opt, **params)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("kind,params", CASES)
def test_lr_sequence_is_deepspeeds(tmp_path, kind, params):
    ours = build_lr_scheduler(lr_config(megazero_args(tmp_path, kind, params)))
    assert [ours.get_lr(n) for n in range(STEPS + 1)] == pytest.approx(deepspeed_lrs(kind, params), rel=1e-12,
                                                                          abs=1e-15)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("steps", [0, -1, 4.0])
def test_deepspeeds_refusals_are_ours(tmp_path, capsys, kind, steps):
    params = {"warmup_num_steps": steps, **({} if kind == "WarmupLR" else {"total_num_steps": 10})}
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        deepspeed_lrs(kind, params)
    with pytest.raises(SystemExit):
        megazero_args(tmp_path, kind, params)
    assert "key 'scheduler.params.warmup_num_steps' must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["OneCycle", "LRRangeTest"])
def test_schedulers_deepspeed_has_and_megazero_refuses(tmp_path, capsys, kind):
    params = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01} if kind == "OneCycle" else {}
    assert kind in lr_schedules.VALID_LR_SCHEDULES  # DeepSpeed accepts it ...
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=OPT_LR, momentum=0.9)
    getattr(lr_schedules, kind)(opt, **params).step()
    with pytest.raises(SystemExit):  # ... megazero names it as not implemented, before any work
        megazero_args(tmp_path, kind, params)
    assert f"scheduler.type '{kind}' is not available in megazero" in capsys.readouterr().err
