"""--train-data-path/--valid-data-path/--test-data-path (Megatron's blend_per_split: each split
from every document of its own prefixes) and the end-of-training evaluation on the validation and
test sets, printed as Megatron-LM core_v0.15.0-0.19.0 print it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megazero.arguments import parse_args
from megazero.data import IndexedDatasetBuilder
from megazero.config.run_config import data_config, schedule_config
from megazero.training.data import build_datasets

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "3",
        "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--seed", "4"]


def corpus(tmp_path, name, low):
    """20 documents of ids in [low, low + 30): which prefix a sample came from shows in its ids."""
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(low)
    for _ in range(20):
        builder.add_document(rng.integers(low, low + 30, rng.integers(8, 40)).tolist())
    builder.finalize(prefix + ".idx")
    return prefix


def per_split_flags(tmp_path):
    a, b, c = corpus(tmp_path, "a", 0), corpus(tmp_path, "b", 30), corpus(tmp_path, "c", 60)
    return ["--train-data-path", a, "--valid-data-path", "1", b, "--test-data-path", c,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-cache-path", str(tmp_path / "cache")]


def test_each_split_reads_its_own_prefixes(tmp_path):
    args = parse_args(BASE + per_split_flags(tmp_path), world_size=1)
    train, valid, test = build_datasets(data_config(args), schedule_config(args), 100)
    assert (len(train), len(valid), len(test)) == (6, 2 * 2, 2)  # 3 x B; (3 // 2 + 1) evals x B; 1 x B
    for ds, low in ((train, 0), (valid, 30), (test, 60)):
        ids = np.concatenate([ds[i]["text"] for i in range(len(ds))])
        assert ids.min() >= low and ids.max() < low + 30
    no_test = parse_args(BASE + per_split_flags(tmp_path)[:5] + per_split_flags(tmp_path)[7:], world_size=1)
    assert build_datasets(data_config(no_test), schedule_config(no_test), 100)[2] is None


@pytest.mark.parametrize("flags,message", [
    (["--mock-data", "--test-data-path", "x"], "--test-data-path with --mock-data: give a single data source"),
    (["--data-path", "x", "--train-data-path", "y"], "--train-data-path with --data-path"),
    (["--valid-data-path", "x"], "--valid-data-path without --train-data-path"),
])
def test_conflicting_sources_are_validation_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(BASE + ["--vocab-size", "100"] + flags, world_size=1, prog="pretrain_gpt.py")
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def run(flags):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, *flags], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return re.findall(r"^ validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: (\S+) \|",
                      out.stdout, re.M)


def test_end_of_training_validation_and_test(tmp_path):
    """Periodic validation at iteration 2, then at the end (iteration 3) the validation set and
    the test set, as Megatron's pretrain() after train()."""
    found = run(per_split_flags(tmp_path))
    assert [(i, w) for i, w, _ in found] == [("2", ""), ("3", " on validation set"), ("3", " on test set")]
    assert len({v for _, _, v in found}) == 3  # three different batches / data
    mock = run(["--mock-data", "--vocab-size", "100", "--split", "98,2,0"])
    assert [(i, w) for i, w, _ in mock] == [("2", ""), ("3", " on validation set")]  # no test share
