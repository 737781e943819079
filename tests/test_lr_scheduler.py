import math

import pytest

from megazero.training.lr_schedule import LRScheduler


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
