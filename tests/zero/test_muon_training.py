"""``pretrain_gpt``'s path with ``--optimizer muon``: every layout trains what one process trains
(fp32 losses within 1e-5): TP 2 + SP, PP 2 + VP 2, ZeRO 1/2/3 at DP 2, CP 2, EP 2 (MoE: one matrix
per expert). Newton-Schulz in fp32 (``--muon-fp32-matmul-prec high``; why: tests/zero/test_muon.py),
Megatron's defaults otherwise (quintic coefficients, spectral scale, split QKV)."""

import numpy as np
import pytest

from megazero.arguments import parse_args
from megazero.testing import run_distributed

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "7", "--mock-data", "--vocab-size", "100", "--train-iters", "4", "--adam-eps", "1e-6",
        "--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-nesterov", "--muon-momentum", "0.9",
        "--muon-tp-mode", "duplicated"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--disable-bias-linear"]


def _train(rank, world_size, argv):
    from megazero.training import setup
    trainer = setup(parse_args(argv, world_size=world_size))
    trainer.train(None)
    trainer.tb.close()
    return trainer.history, trainer.optimizer.muon is not None


def losses(world, argv):
    hist, used = run_distributed(_train, world, argv, timeout_s=240)[-1]
    assert used
    return np.array([l for _, l in hist])


LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]),
    "pp2_vp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "pp2_zb_h1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),  # W deferred
    "dp2_zero1": (2, ["--zero-stage", "1"]),
    "dp2_zero2": (2, ["--zero-stage", "2"]),
    "dp2_zero3": (2, ["--zero-stage", "3"]),
    "cp2": (2, ["--context-parallel-size", "2", "--zero-stage", "1"]),
    "tp2_dp2_zero3": (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]),
}


@pytest.fixture(scope="module")
def one_process():
    return losses(1, TINY)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_muon_layout_equals_one_process(one_process, name):
    world, flags = LAYOUTS[name]
    got = losses(world, TINY + flags)
    assert len(got) == 4 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, one_process, rtol=1e-5, err_msg=name)


def test_muon_experts_ep2_equal_one_process():
    base = losses(1, TINY + MOE)
    got = losses(2, TINY + MOE + ["--expert-model-parallel-size", "2", "--zero-stage", "2"])
    np.testing.assert_allclose(got, base, rtol=1e-5)


def test_muon_bad_settings_are_one_line():
    import contextlib
    import io
    for flags, needle in [(["--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
                          (["--muon-tp-mode", "blockwise", "--tensor-model-parallel-size", "2"], "--muon-tp-mode blockwise"),
                          (["--muon-coefficient-type", "custom"], "--muon-coefficient-type"),
                          (["--fp16"], "--fp16"), (["--optimizer", "lion"], "--optimizer lion"),
                          (["--muon-fp32-matmul-prec", "low"], "low")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            parse_args(TINY + flags, world_size=1)
        line = err.getvalue().strip().splitlines()[-1]
        assert needle in line, line


def test_deepspeed_config_muon_block_for_pretrain_gpt(tmp_path):
    """``--deepspeed-config`` with DeepSpeed's Muon block: its settings (gram, Nesterov, DeepSpeed's
    Adam-half defaults); refused when the halves' lr differ (DeepSpeed's 0.02 / 3e-4 defaults)."""
    import contextlib
    import io
    import json
    from megazero.config.optimizer import OptimizerConfig
    base = [a for a in TINY[:TINY.index("--optimizer")] if a not in ("--lr", "2e-3", "--adam-eps", "1e-6")]
    path = tmp_path / "ds.json"
    block = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
             "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.05}}}
    path.write_text(json.dumps(block))
    args = parse_args(base + ["--deepspeed-config", str(path)], world_size=1)
    cfg = OptimizerConfig.from_args(args)
    assert (cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps) == (1e-3, 0.05, (0.9, 0.95), 1e-10)
    assert cfg.muon["flavour"] == "deepspeed_gram" and cfg.muon["momentum"] == 0.9 and cfg.muon["nesterov"]
    del block["optimizer"]["params"]["lr"]
    path.write_text(json.dumps(block))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse_args(base + ["--deepspeed-config", str(path)], world_size=1)
    assert "different lr" in err.getvalue()
