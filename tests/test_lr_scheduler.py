import math
from types import SimpleNamespace

import pytest

from megazero.config.run_config import lr_config
from megazero.optim.lr_schedule import DeepSpeedLRScheduler, LRScheduler, build_lr_scheduler


def test_warmup_then_linear_and_cosine_decay():
    s = LRScheduler(1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="linear")
    assert s.get_lr(0) == 0.0 and s.get_lr(5) == 0.5 and s.get_lr(10) == 1.0
    assert s.get_lr(60) == pytest.approx(0.55) and s.get_lr(110) == pytest.approx(0.1) and s.get_lr(500) == 0.1
    c = LRScheduler(1.0, min_lr=0.0, warmup_iters=0, decay_iters=100, decay_style="cosine")
    assert c.get_lr(0) == 1.0 and c.get_lr(50) == pytest.approx(0.5) and c.get_lr(100) == pytest.approx(0.0)
    assert c.get_lr(25) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    k = LRScheduler(0.3, warmup_iters=2, decay_iters=10, decay_style="constant")
    assert [k.get_lr(n) for n in (1, 2, 3, 50)] == [0.15, 0.3, 0.3, 0.3]


def test_state_round_trip_and_mismatch():
    s = LRScheduler(1.0, warmup_iters=3, decay_iters=10)
    for _ in range(4):
        s.step()
    t = LRScheduler(1.0, warmup_iters=3, decay_iters=10)
    t.load_state_dict(s.state_dict())
    assert t.get_lr() == s.get_lr() and t.num_steps == 4
    with pytest.raises(ValueError, match="warmup_iters was 3, now 5"):
        LRScheduler(1.0, warmup_iters=5, decay_iters=10).load_state_dict(s.state_dict())


# ---- DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py 0.19.8), worked out by hand -------
# (tests/peers/test_deepspeed_schedules.py compares them with the real classes)
# After n optimizer steps DeepSpeed's last_batch_iteration is t = n - 1; W = max(2, warmup_num_steps).

def test_deepspeed_warmup_decay_log_and_linear():
    s = DeepSpeedLRScheduler("WarmupDecayLR", warmup_min_lr=1e-5, warmup_max_lr=6e-4, warmup_num_steps=100,
                             total_num_steps=1000)
    lo, hi = 1e-5, 6e-4
    assert s.get_lr(0) == lo  # before the first step: the optimizer was set to warmup_min_lr
    assert s.get_lr(1) == lo  # t = 0: ln(1) / ln(100) = 0
    assert s.get_lr(11) == pytest.approx(lo + (hi - lo) * math.log(11) / math.log(100))
    assert s.get_lr(100) == pytest.approx(hi)  # t = 99: ln(100) / ln(100)
    assert s.get_lr(101) == pytest.approx(hi)  # t = 100: (1000 - 100) / 900
    assert s.get_lr(551) == pytest.approx(lo + (hi - lo) * 0.5)  # t = 550: 450 / 900
    assert s.get_lr(1001) == pytest.approx(lo) and s.get_lr(2000) == pytest.approx(lo)
    lin = DeepSpeedLRScheduler("WarmupDecayLR", warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear",
                               total_num_steps=20)
    assert [lin.get_lr(n) for n in (0, 1, 2, 6, 10, 11, 16, 21)] == pytest.approx(
        [0.0, 0.0, 0.1, 0.5, 0.9, 1.0, 0.5, 0.0])


def test_deepspeed_warmup_lr_defaults_and_min_two_steps():
    s = DeepSpeedLRScheduler("WarmupLR")  # DeepSpeed's defaults: 0 -> 0.001 over 1000 steps, log
    assert s.get_lr(501) == pytest.approx(0.001 * math.log(501) / math.log(1000))
    assert s.get_lr(1001) == 0.001 and s.get_lr(10 ** 6) == 0.001
    z = DeepSpeedLRScheduler("WarmupLR", warmup_min_lr=0.2, warmup_max_lr=1.0, warmup_num_steps=1)
    assert [z.get_lr(n) for n in (0, 1, 2, 3)] == pytest.approx([0.2, 0.2, 1.0, 1.0])  # W = max(2, 1)
    for bad in (0, -3, 4.0, True):  # DeepSpeed 0.19.8: "warmup_num_steps must be a positive integer"
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
            DeepSpeedLRScheduler("WarmupLR", warmup_num_steps=bad)
    zl = DeepSpeedLRScheduler("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert [zl.get_lr(n) for n in (1, 2, 3)] == pytest.approx([0.0, 0.5, 1.0])


def test_deepspeed_warmup_cosine():
    s = DeepSpeedLRScheduler("WarmupCosineLR", base_lr=1e-3, total_num_steps=100, warmup_num_steps=10,
                             warmup_min_ratio=0.1, cos_min_ratio=0.01, warmup_type="linear")
    assert s.get_lr(0) == 0.0  # DeepSpeed's get_lr before the first step returns 0
    assert s.get_lr(1) == pytest.approx(1e-4) and s.get_lr(6) == pytest.approx(5.5e-4)
    cos = lambda x: 1e-3 * (0.01 + 0.99 * (1 + math.cos(math.pi * x)) / 2)  # noqa: E731
    assert s.get_lr(11) == pytest.approx(cos(1 / 90))  # t = 10: (t - W + 1) / (T - W)
    assert s.get_lr(56) == pytest.approx(cos(46 / 90))
    assert s.get_lr(100) == pytest.approx(1e-5)  # t = 99: x = 1 -> cos_min_ratio
    assert s.get_lr(110) == pytest.approx(1e-5) and s.get_lr(500) == pytest.approx(1e-5)  # clamped past T
    short = DeepSpeedLRScheduler("WarmupCosineLR", base_lr=1.0, total_num_steps=5, warmup_num_steps=10,
                                 cos_min_ratio=0.25, warmup_type="linear")  # T <= W: accepted, T - W -> 1
    assert [short.get_lr(n) for n in (1, 6, 10, 11, 12)] == pytest.approx([0.0, 0.5, 0.9, 0.25, 0.25])


def test_deepspeed_state_and_errors():
    s = DeepSpeedLRScheduler("WarmupLR", warmup_max_lr=0.5, warmup_num_steps=4)
    for _ in range(3):
        s.step()
    t = DeepSpeedLRScheduler("WarmupLR", warmup_max_lr=0.5, warmup_num_steps=4)
    t.load_state_dict(s.state_dict())
    assert t.num_steps == 3 and t.get_lr() == s.get_lr()
    with pytest.raises(ValueError, match="warmup_num_steps was 4, now 5"):
        DeepSpeedLRScheduler("WarmupLR", warmup_max_lr=0.5, warmup_num_steps=5).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="type was None"):
        t.load_state_dict(LRScheduler(1.0).state_dict())
    with pytest.raises(ValueError, match="needs total_num_steps"):
        DeepSpeedLRScheduler("WarmupDecayLR")
    with pytest.raises(ValueError, match="OneCycle"):
        DeepSpeedLRScheduler("OneCycle")


def test_build_lr_scheduler_picks_the_schedule():
    base = dict(lr=0.3, min_lr=0.0, lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="constant",
                train_iters=10, train_samples=None, global_batch_size=4, lr_warmup_fraction=None, lr_warmup_init=0.0,
                override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False,
                lr_decay_samples=None, lr_warmup_samples=0, decoupled_lr=None, decoupled_min_lr=None)
    megatron = build_lr_scheduler(lr_config(SimpleNamespace(**base, deepspeed_scheduler=None)))
    # Megatron counts samples: 2 warm-up iterations of 4 samples = 8; one step (4 samples) in: half the peak
    assert isinstance(megatron, LRScheduler) and megatron.get_lr(4) == 0.15
    ds = build_lr_scheduler(lr_config(SimpleNamespace(**base, deepspeed_scheduler={
        "type": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 0.3, "warmup_num_steps": 2,
        "warmup_type": "linear"})))
    assert isinstance(ds, DeepSpeedLRScheduler) and [ds.get_lr(n) for n in (1, 2, 3)] == [0.0, 0.15, 0.3]
    with pytest.raises(ValueError, match="--lr is required"):
        build_lr_scheduler(lr_config(SimpleNamespace(**{**base, "lr": None}, deepspeed_scheduler=None)))


def megatron_args(**changes):
    base = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="linear", train_iters=10,
                train_samples=None, lr_decay_samples=None, lr_warmup_samples=0, global_batch_size=8,
                lr_warmup_fraction=None, lr_warmup_init=0.0, override_opt_param_scheduler=False,
                use_checkpoint_opt_param_scheduler=False, deepspeed_scheduler=None, decoupled_lr=None,
                decoupled_min_lr=None)
    return lr_config(SimpleNamespace(**{**base, **changes}))


def test_megatron_schedule_in_samples_fraction_and_init():
    """get_optimizer_param_scheduler (Megatron-LM core_v0.19.0): iteration runs use iters x B
    steps, sample runs the samples; --lr-warmup-fraction of the decay length; --lr-warmup-init."""
    s = build_lr_scheduler(megatron_args(lr_warmup_iters=2, lr_warmup_init=0.2))
    assert (s.warmup_iters, s.decay_iters) == (16, 80)
    assert s.get_lr(0) == 0.2 and s.get_lr(8) == pytest.approx(0.6) and s.get_lr(16) == 1.0
    s = build_lr_scheduler(megatron_args(train_iters=None, train_samples=1000, lr_decay_samples=900,
                                         lr_warmup_fraction=0.1))
    assert (s.warmup_iters, s.decay_iters) == (90, 900)
    assert s.get_lr(45) == pytest.approx(0.5) and s.get_lr(495) == pytest.approx(0.55)
    s = build_lr_scheduler(megatron_args(train_iters=None, train_samples=1000, lr_warmup_samples=100))
    assert (s.warmup_iters, s.decay_iters) == (100, 1000)
    assert s.step(8) == pytest.approx(0.08)


def test_override_and_use_checkpoint_scheduler():
    saved = build_lr_scheduler(megatron_args())
    saved.step(24)
    state = saved.state_dict()
    changed = megatron_args(lr=2.0)
    with pytest.raises(ValueError, match="--override-opt_param-scheduler"):
        build_lr_scheduler(changed).load_state_dict(state)
    kept = build_lr_scheduler(megatron_args(lr=2.0, override_opt_param_scheduler=True))
    kept.load_state_dict(state)
    assert kept.lr == 2.0 and kept.num_steps == 24
    taken = build_lr_scheduler(megatron_args(lr=2.0, use_checkpoint_opt_param_scheduler=True))
    taken.load_state_dict(state)
    assert taken.lr == 1.0 and taken.get_lr() == saved.get_lr()


def test_a_state_counted_in_iterations_loads_as_samples():
    """Checkpoints saved before the schedule counted samples hold iterations (no "unit")."""
    old = {"num_steps": 3, "init_lr": 0.0, "lr": 1.0, "min_lr": 0.1, "warmup_iters": 2, "decay_iters": 10,
           "decay_style": "cosine"}
    s = LRScheduler(1.0, min_lr=0.1, warmup_iters=16, decay_iters=80, decay_style="cosine", samples_per_step=8)
    s.load_state_dict(old)
    assert s.num_steps == 24 and s.state_dict()["unit"] == "samples"
    fresh = LRScheduler(1.0, min_lr=0.1, warmup_iters=16, decay_iters=80, decay_style="cosine", samples_per_step=8)
    for _ in range(3):
        fresh.step(8)
    assert s.get_lr() == fresh.get_lr()
