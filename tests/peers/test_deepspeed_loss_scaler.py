"""The engine's fp16 dynamic loss scale follows DeepSpeed 0.19.8's rule: megazero's
:class:`~megazero.zero.loss_scaler.DeepSpeedLossScaler` against the real
``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` on fixed overflow patterns (windows,
hysteresis, ``consecutive_hysteresis`` both ways, the error at the minimum scale), and
``megazero.initialize`` against ``deepspeed.initialize`` from scratch with a window of 2, where
Megatron's rule (growth one step sooner) would already differ: same losses, scales and skipped
steps at every step."""

import random
import warnings

import pytest
import torch

from tests.engine.hf_tiny import groups
from tests.peers.test_deepspeed_checkpoints import TOL, _fp16_train, _model, ds_config, fp16

PATTERNS = [[0] * 9, [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1, 0, 0, 0, 1]]
PATTERNS += [[int(random.Random(seed).random() < 0.3) for _ in range(40)] for seed in range(4)]


def _sequences(rank, world):
    """(megazero's, DeepSpeed's) scales and errors on every pattern x settings."""
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from megazero.zero.loss_scaler import DeepSpeedLossScaler
    deepspeed.init_distributed(dist_backend="gloo")  # update_scale logs with dist.get_rank()
    out = []
    for pattern in PATTERNS:
        for window in (1, 2, 3, 5):
            for hysteresis in (1, 2, 3):
                for consecutive in (False, True):
                    for raise_at_min in (False, True):
                        ours = DeepSpeedLossScaler(2.0 ** 6, 2.0, window, hysteresis, consecutive, raise_at_min)
                        theirs = DynamicLossScaler(2.0 ** 6, window, 2.0, hysteresis, consecutive, raise_at_min)
                        out.append((_run(ours.update, lambda: ours.scale, pattern),
                                    _run(theirs.update_scale, lambda: theirs.cur_scale, pattern)))
    return out


def _run(update, scale, pattern):
    seq = []
    for overflow in pattern:
        try:
            update(bool(overflow))
        except Exception:  # noqa: BLE001 -- DeepSpeed raises a bare Exception at the minimum scale
            return seq + ["stopped at the minimum"]
        seq.append(scale())
    return seq


def test_scale_sequences_equal_deepspeeds_dynamic_loss_scaler(deepspeed_ranks):
    pairs = deepspeed_ranks(_sequences, 1)[0]
    assert len(pairs) == len(PATTERNS) * 48
    assert any("stopped at the minimum" in b for _, b in pairs) and any(len(set(b)) > 3 for _, b in pairs)
    for ours, theirs in pairs:
        assert ours == theirs


def _fresh_run(rank, world, system, stage, data, power):
    warnings.filterwarnings("ignore")
    model = _model("odd")
    cfg = {**ds_config(stage, system), "fp16": fp16(power)}
    if system == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True  # as in test_deepspeed_checkpoints
        deepspeed.init_distributed(dist_backend="gloo")
        engine, scale_of = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)[0], \
            lambda e: e.optimizer.loss_scale
    else:
        import megazero
        engine = megazero.initialize(model=model, model_parameters=groups(model), config=cfg)[0]
        scale_of = lambda e: e.loss_scale  # noqa: E731
    micro = lambda step: [(a.half(), b) for a, b in step[rank]]  # noqa: E731
    return _fp16_train(engine, data, micro, scale_of), engine.skipped_steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_fp16_scale_follows_deepspeed_from_scratch(stage, deepspeed_ranks):
    """Window 2, hysteresis 2, from 2 ** 8 (no natural overflow); a NaN input on rank 0 forces an
    overflow at steps 3, 7 and 8 in both. DeepSpeed's rule: growth at steps 2 and 6 (W + 1 clean
    steps), the overflow at 3 and 7 spends the hysteresis, the one at 8 backs off. Megatron's rule
    would grow at steps 1 and 5."""
    g = torch.Generator().manual_seed(3)
    data = [[[(torch.randn(2, 5, generator=g), torch.randn(2, 2, generator=g)) for _ in range(2)]
             for _ in range(2)] for _ in range(9)]
    for step in (3, 7, 8):
        data[step][0][1][0].fill_(float("nan"))
    ours = deepspeed_ranks(_fresh_run, 2, "megazero", stage, data, 8, timeout_s=600)
    theirs = deepspeed_ranks(_fresh_run, 2, "deepspeed", stage, data, 8, timeout_s=600)
    for rank, (((losses, scales), skipped), ((want, want_scales), want_skipped)) in enumerate(zip(ours, theirs)):
        assert scales == want_scales == [256, 256, 512, 512, 512, 512, 1024, 1024, 512], (scales, want_scales)
        assert skipped == want_skipped == 3, (skipped, want_skipped)
        finite = [(a, b) for a, b in zip(losses, want) if a == a or b == b]  # NaN losses: the forced steps
        assert len(finite) == 9 * 2 - 3 * (rank == 0), (rank, losses, want)
        assert max(abs(a - b) / abs(b) for a, b in finite) <= TOL, (losses, want)
