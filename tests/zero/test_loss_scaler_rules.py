"""DeepSpeed's dynamic loss-scale rule (:class:`DeepSpeedLossScaler`, the engine's) against
Megatron's (:class:`DynamicLossScaler`, ``pretrain_gpt``'s); tests/peers/test_deepspeed_loss_scaler.py
compares it with DeepSpeed's own class."""

import pytest

from megazero.zero.loss_scaler import DeepSpeedLossScaler, DynamicLossScaler, make_loss_scaler

PATTERN = [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # 1: an overflowed step


def _scales(scaler, pattern=PATTERN):
    out = []
    for overflow in pattern:
        scaler.update(bool(overflow))
        out.append(scaler.scale)
    return out


def test_deepspeed_rule_scale_sequence():
    # DeepSpeed 0.19.8 DynamicLossScaler.update_scale, window W=2, delayed_shift H=2, by hand:
    # steps 0-3 clean: stable = cur_iter - last_overflow_iter - 1 = 0,1,2,3 -> grows at 2 (W+1 clean);
    # step 4 overflow: hysteresis 2 -> 1, no back-off; steps 5-7: stable 0,1,2 -> grows at 7 (hysteresis
    # back to 2); 8: 2 -> 1; 9-12: back off each time (hysteresis stays 1); 13-17: grows at 15 and 17.
    want = [16, 16, 32, 32, 32, 32, 32, 64, 64, 32, 16, 8, 4, 4, 4, 8, 8, 16]
    assert _scales(DeepSpeedLossScaler(16.0, min_scale=2.0, window=2, hysteresis=2)) == want
    # Megatron's rule grows after W clean steps: one step sooner
    assert _scales(DynamicLossScaler(16.0, min_scale=2.0, window=2, hysteresis=2))[:3] == [16, 32, 32]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DeepSpeedLossScaler(16.0, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _scales(s, [1, 0, 1, 0, 1, 1]) == [16, 16, 16, 16, 16, 8]
    s = DeepSpeedLossScaler(16.0, window=100, hysteresis=2)
    assert _scales(s, [1, 0, 1, 0, 1, 1]) == [16, 16, 8, 8, 4, 2]


def test_minimum_scale_stops_the_run_at_zero_stages_1_to_3_only():
    s = make_loss_scaler(None, None, True, 4.0, 2.0, 10, 1, rule="deepspeed", stage=2)
    s.update(True)
    assert s.scale == 2.0
    with pytest.raises(RuntimeError, match="min_loss_scale"):
        s.update(True)
    s = make_loss_scaler(None, None, True, 4.0, 2.0, 10, 1, rule="deepspeed", stage=0)
    assert _scales(s, [1, 1, 1]) == [2.0, 2.0, 2.0]  # stage 0's FP16_Optimizer floors at the minimum


def test_state_round_trip_and_old_megatron_rule_counters():
    s = DeepSpeedLossScaler(16.0, window=3, hysteresis=2)
    _scales(s, [0, 1, 0, 0])
    other = DeepSpeedLossScaler(window=3, hysteresis=2)
    other.load_state_dict(s.state_dict())
    assert other.state_dict() == s.state_dict() == {"scale": 16.0, "cur_iter": 4, "last_overflow_iter": 1,
                                                    "cur_hysteresis": 1}
    assert _scales(other, [0] * 5) == _scales(s, [0] * 5)
    # an older engine checkpoint (Megatron-rule growth_tracker g): grows W - g clean steps on
    for g in range(3):
        old = DeepSpeedLossScaler(window=3, hysteresis=2)
        old.load_state_dict({"scale": 8.0, "growth_tracker": g, "hysteresis_tracker": 0})
        assert _scales(old, [0] * (3 - g)) == [8.0] * (2 - g) + [16.0] and old.cur_hysteresis == 2
