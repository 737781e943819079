"""ds_config values checked where they enter (issue 29 and issue 30 section 1): DeepSpeed 0.19.8's
scheduler rules (WarmupLR's max from the optimizer's lr, WarmupCosineLR's clamp, positive integer
warm-up), the ZeRO keys 0.19.8 accepts, and every number finite and in range with the key named.
tests/peers/test_deepspeed_*.py checks the same rules against the installed DeepSpeed."""

import json

import pytest

from megazero.arguments import parse_args
from megazero.config.run_config import lr_config
from megazero.optim.lr_schedule import build_lr_scheduler

SHAPE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"]
MB = {"train_micro_batch_size_per_gpu": 1}


def parse(tmp_path, config, extra=()):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**MB, **config}))
    return parse_args(["--deepspeed-config", str(path), *SHAPE, *extra], world_size=2, prog="pretrain_gpt.py")


def error(capsys, tmp_path, config, extra=()):
    with pytest.raises(SystemExit) as exc:
        parse(tmp_path, config, extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err.split(": ", 3)[-1]


def test_warmup_lr_without_max_takes_the_optimizers_lr(tmp_path, capsys):
    opt = {"optimizer": {"type": "AdamW", "params": {"lr": 3.3e-3}}}
    a = parse(tmp_path, {**opt, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}})
    assert a.deepspeed_scheduler["warmup_max_lr"] == 3.3e-3 and build_lr_scheduler(lr_config(a)).get_lr(5) == 3.3e-3
    a = parse(tmp_path, {"scheduler": {"type": "WarmupLR"}}, ["--lr", "0.02"])  # the client optimizer's lr
    assert a.deepspeed_scheduler["warmup_max_lr"] == 0.02
    # WarmupDecayLR keeps its own default 0.001 (its constructor passes 0.001 on)
    a = parse(tmp_path, {**opt, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}})
    assert a.deepspeed_scheduler["warmup_max_lr"] == 0.001


def test_warmup_cosine_accepts_short_totals(tmp_path):
    a = parse(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 3,
                                                                            "warmup_num_steps": 5}}}, ["--lr", "1"])
    s = build_lr_scheduler(lr_config(a))
    assert s.get_lr(100) == pytest.approx(1e-4)  # past T: clamped at cos_min_ratio


@pytest.mark.parametrize("value", [0, -2, 4.0, 1e3])
def test_warmup_num_steps_positive_integer(tmp_path, capsys, value):
    err = error(capsys, tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": value}}},
                ["--lr", "1"])
    assert err == f"key 'scheduler.params.warmup_num_steps' must be a positive integer, got {value!r} " \
        "(DeepSpeed's own check)"


def test_zero_keys_of_the_current_release(tmp_path, capsys):
    zero = {"stage": 3, "stage3_allgather_sequential": True, "parameter_alignment": True, "prefetch_bucket_size": 7,
            "max_live_parameters": 9, "enable_sanity_checks": False}
    with pytest.warns(UserWarning, match="stage3_allgather_sequential"):
        a = parse(tmp_path, {"zero_optimization": zero}, ["--lr", "1"])
    assert (a.zero_prefetch_bucket_size, a.zero_max_live_parameters) == (7, 9)  # unprefixed names honoured
    with pytest.warns(UserWarning, match="compute_grad_norm"):
        parse(tmp_path, {"zero_optimization": {"stage": 2, "compute_grad_norm": False}}, ["--lr", "1"])
    assert error(capsys, tmp_path, {"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, ["--lr", "1"]) \
        == ("zero_optimization.compute_grad_norm=false is supported only with ZeRO Stage 1 or 2 and without "
            "gradient_clipping (stage 3, clipping 0.0)")
    assert "give one" in error(capsys, tmp_path, {"zero_optimization": {"prefetch_bucket_size": 1,
                                                                        "stage3_prefetch_bucket_size": 2}})
    assert "zero_optimization.zenflow" in error(capsys, tmp_path, {"zero_optimization": {"zenflow": {}}},
                                                ["--lr", "1"])
    with pytest.warns(UserWarning, match="optimizer.params.fp32_optimizer_states"):
        parse(tmp_path, {"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": True}}})


@pytest.mark.parametrize("config, flags, message", [
    ({"gradient_clipping": float("nan")}, ["--lr", "1"], "key 'gradient_clipping' must be a finite number, got nan"),
    ({"gradient_clipping": -1.0}, ["--lr", "1"], "key 'gradient_clipping' must be >= 0, got -1.0"),
    ({"gradient_clipping": float("inf")}, ["--lr", "1", "--clip-grad", "1"],
     "key 'gradient_clipping' must be a finite number, got inf"),  # overridden by the flag, still checked
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, [],
     "key 'optimizer.params.lr' must be a finite number, got nan"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, [],
     "key 'optimizer.params.betas[1]' must be < 1, got 1.0"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, [], "key 'optimizer.params.eps' must be >= 0"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, ["--lr", "1"],
     "key 'zero_optimization.reduce_bucket_size' must be > 0, got 0"),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, ["--lr", "1"],
     "key 'fp16.initial_scale_power' must be < 128, got 200"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, ["--lr", "1", "--zero-stage", "1"],
     "key 'fp16.hysteresis' must be >= 1, got 0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("inf")}}}, ["--lr", "1"],
     "key 'scheduler.params.warmup_max_lr' must be a finite number, got inf"),
    ({"train_micro_batch_size_per_gpu": 4}, ["--lr", "1", "--micro-batch-size", "2"],
     "key 'train_micro_batch_size_per_gpu' = 4 disagrees with --micro-batch-size 2"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, ["--lr", "1", "--global-batch-size", "4"],
     "key 'train_batch_size' = 8 disagrees with --global-batch-size 4"),
    ({"scheduler": {"type": "OneCycle"}}, ["--lr", "1"], "(DeepSpeed has it; megazero does not implement it)"),
])
def test_numbers_are_checked_where_they_enter(tmp_path, capsys, config, flags, message):
    assert message in error(capsys, tmp_path, config, flags)
