"""Muon's state in checkpoints: its momentum lives in each region's ``exp_avg`` shard, so it is
saved, resumed and resharded by the same per-parameter machinery as Adam's moments. A run saved at
iteration 3 and resumed (same layout: every later loss identical; another TP/DP/ZeRO layout: within
1e-5) trains what the run without a stop trains; loading an AdamW checkpoint with ``--optimizer
muon`` (or the reverse) stops with one line unless ``--no-load-optim``."""

import numpy as np
import pytest
import torch

from megazero.arguments import parse_args
from megazero.testing import run_distributed
from tests.checkpoint.test_convert_checkpoint import tool
from tests.test_training import make_dataset
from tests.zero.test_muon_training import TINY as MUON

COMMON = [a for a in MUON if a not in ("--mock-data",)]
COMMON = COMMON[:COMMON.index("--vocab-size")] + COMMON[COMMON.index("--vocab-size") + 2:]
COMMON = [("8" if a == "4" and COMMON[i - 1] == "--train-iters" else a) for i, a in enumerate(COMMON)]
COMMON += ["--save-interval", "100"]
A = ["--zero-stage", "1"]                                            # DP 2
B = ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]      # TP 2, DP 1


def _train(rank, world_size, argv):
    from megazero.training import setup
    trainer = setup(parse_args(argv, world_size=world_size))
    trainer.train(None)
    trainer.tb.close()
    return trainer.history


def run(argv, world=2):
    return run_distributed(_train, world, argv, timeout_s=240)[-1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("muon_ck"))


def test_resume_and_reshard_are_exact(tmp_path, data):
    common = COMMON + data
    full = run(common + A + ["--save", str(tmp_path / "full")])
    first = run(common + A + ["--save", str(tmp_path / "ck"), "--exit-interval", "3"])
    assert [i for i, _ in first] == [1, 2, 3]
    same = run(common + A + ["--load", str(tmp_path / "ck"), "--save", str(tmp_path / "same")])
    assert [l for _, l in first + same] == [l for _, l in full], "resumed Muon run diverged"
    other = run(common + B + ["--load", str(tmp_path / "ck"), "--save", str(tmp_path / "other")])
    np.testing.assert_allclose([l for _, l in other], [l for _, l in full][3:], rtol=1e-5)
    # exported to fp32 (tools/convert_checkpoint.py to-fp32): the two layouts' final masters agree
    conv = tool()
    a, b = conv.to_fp32(str(tmp_path / "same"), str(tmp_path / "a.pt")), conv.to_fp32(str(tmp_path / "other"),
                                                                                       str(tmp_path / "b.pt"))
    assert sorted(a) == sorted(b) and any(t.dim() == 2 for t in a.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_optimizer_mismatch_is_one_line(tmp_path, data, capfd):
    i = COMMON.index("--optimizer")
    adam = COMMON[:i] + COMMON[i + 9:] + data + A  # without the 9 Muon items of test_muon_training.TINY
    run(adam + ["--save", str(tmp_path / "adam"), "--exit-interval", "2"])
    with pytest.raises(Exception) as failed:
        run(COMMON + data + A + ["--load", str(tmp_path / "adam")])
    assert "optimizer state is adam's" in str(failed.value) + capfd.readouterr().err
    hist = run(COMMON + data + A + ["--load", str(tmp_path / "adam"), "--no-load-optim", "--finetune"])
    assert len(hist) == 8
