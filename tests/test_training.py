"""pretrain_gpt end to end: the layout never changes the training, resume is exact, signals save,
TensorBoard holds Megatron's scalar names, and the script runs under torchrun."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megazero.arguments import parse_args
from megazero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "7"]
MOCK = ["--mock-data", "--vocab-size", "100"]


def layout_flags(tp, pp, vp, zero):
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--zero-stage", str(zero)]
    if vp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(4 // (pp * vp))]
    return flags


def _train(rank, world_size, argv):
    from megazero.training import setup
    import signal as _signal
    from megazero.training.signals import ExitSignal
    args = parse_args(argv, world_size=world_size)
    trainer = setup(args)
    trainer.train(ExitSignal.install((_signal.SIGUSR1,)))
    trainer.tb.close()
    return trainer.history


def train(world, argv):
    results = run_distributed(_train, world, argv, timeout_s=240)
    return results[-1]  # the last rank owns the loss


LAYOUTS = [(1, 1, None, 1, 0), (2, 1, None, 2, 1), (1, 2, 2, 2, 2), (2, 2, 2, 2, 3)]


def test_parallel_layout_never_changes_the_training():
    base = None
    for tp, pp, vp, dp, zero in LAYOUTS:
        hist = train(tp * pp * dp, TINY + MOCK + ["--train-iters", "4"] + layout_flags(tp, pp, vp, zero))
        losses = np.array([l for _, l in hist])
        assert len(losses) == 4 and np.all(np.isfinite(losses))
        if base is None:
            base = losses
        else:
            np.testing.assert_allclose(losses, base, rtol=1e-5, err_msg=f"layout TP{tp} PP{pp} VP{vp} DP{dp} Z{zero}")


def make_dataset(tmp_path):
    """A small NullTokenizer dataset so that 8 iterations span more than one epoch."""
    from megazero.data import IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        builder.add_document(rng.integers(0, 99, rng.integers(5, 30)).tolist())
    builder.finalize(prefix + ".idx")
    return ["--data-path", prefix, "--split", "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.mark.parametrize("precision,layout", [
    ([], (2, 1, None, 1)),
    (["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "3"], (2, 1, None, 1)),
    (["--bf16"], (1, 2, 2, 3)),
])
def test_resume_is_exact(tmp_path, precision, layout):
    data = make_dataset(tmp_path)
    common = TINY + data + precision + layout_flags(*layout) + ["--train-iters", "8", "--save-interval", "100"]
    full = train(4, common + ["--save", str(tmp_path / "full")])
    first = train(4, common + ["--save", str(tmp_path / "ck"), "--exit-interval", "3"])
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    second = train(4, common + ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck")])
    assert [i for i, _ in first + second] == list(range(1, 9))
    assert [l for _, l in first + second] == [l for _, l in full], "resumed run diverged"


def _signalled(rank, world_size, argv):
    if rank == 0:
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    return _train(rank, world_size, argv)


def test_sigusr1_saves_and_exits(tmp_path):
    argv = TINY + MOCK + ["--train-iters", "100000", "--save", str(tmp_path / "ck"), "--log-interval", "50"]
    run_distributed(_signalled, 2, argv, timeout_s=120)
    it = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert 0 < it < 100000 and (tmp_path / "ck" / f"iter_{it:07d}" / "rank_00001.pt").exists()


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = tmp_path / "tb"
    train(2, TINY + MOCK + ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                            "--tensorboard-dir", str(tb), "--log-timers-to-tensorboard", "--log-throughput",
                            "--log-validation-ppl-to-tensorboard"])
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size", "iteration-time", "throughput",
                 "lm loss validation", "lm loss validation ppl"):
        assert name in tags and f"{name} vs samples" in tags, name
    assert len(acc.Scalars("lm loss")) == 3


def test_pipeline_trace_flag_writes_the_third_step(tmp_path):
    import json
    path = tmp_path / "trace.json"
    train(2, TINY + MOCK + ["--train-iters", "4", "--pipeline-model-parallel-size", "2", "--pipeline-trace", str(path)])
    events = json.loads(path.read_text())["traceEvents"]
    assert {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1}  # both stages' intervals


def test_torchrun_end_to_end(tmp_path):
    """The real script under torchrun: Megatron log lines, a checkpoint, exit 0; bad input exits 2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "pretrain_gpt.py"), *TINY, *MOCK, "--train-iters", "3", "--tensor-model-parallel-size", "2",
           "--save", str(tmp_path / "ck")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration ", l)]
    assert len(lines) == 3 and "| lm loss: " in lines[-1] and "number of nan iterations:   0 |" in lines[-1]
    assert (tmp_path / "ck" / "iter_0000003" / "metadata.json").exists()


def _one_rank_dies(rank, world_size, argv):
    import time
    from megazero.training import setup
    from megazero.training.signals import ExitSignal
    trainer = setup(parse_args(argv, world_size=world_size))
    if rank == 1:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.time()
    try:
        trainer.train(ExitSignal())
    except Exception as e:  # the survivors must fail, not hang until the collective timeout
        return time.time() - start, f"{type(e).__name__}: {e}"
    return None


def test_killed_rank_makes_the_others_fail_fast():
    from megazero.testing import RankFailure
    argv = TINY + MOCK + ["--train-iters", "100000", "--log-interval", "100000", "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "10"]
    with pytest.raises(RankFailure, match=r"first: rank 1\).*\n.*\n.*exit code -9") as exc:
        run_distributed(_one_rank_dies, 4, argv, timeout_s=120, grace_s=60)
    assert "still running" not in str(exc.value)  # every survivor returned (with its error) within the grace


def _fp16_counts(rank, world_size, argv):
    from megazero.training import setup
    trainer = setup(parse_args(argv, world_size=world_size))
    trainer.train(None)
    return trainer.iteration, trainer.skipped, trainer.scheduler.num_steps, trainer.consumed_samples


def test_fp16_overflow_steps_do_not_advance_the_lr_schedule():
    """Megatron's train_step: a skipped (overflow) step leaves the LR schedule where it was, while
    the iteration and consumed samples still count it. 2^24 overflows fp16 gradients at first;
    the dynamic scaler halves it each skipped step until steps apply."""
    argv = TINY + MOCK + ["--train-iters", "12", "--fp16", "--initial-loss-scale", str(2.0 ** 24), "--hysteresis", "1"]
    iteration, skipped, scheduler_steps, consumed = run_distributed(_fp16_counts, 1, argv, timeout_s=120)[0]
    assert iteration == 12 and consumed == 12 * 8
    assert 0 < skipped < 12 and scheduler_steps == (iteration - skipped) * 8  # Megatron's schedule counts samples


def test_first_run_with_load_pointing_at_a_missing_folder_starts_from_scratch(tmp_path):
    """Megatron's requeue scripts pass --save X --load X from the first run on: a --load folder
    that does not exist yet means "start from scratch", and the second run resumes from it."""
    ck = str(tmp_path / "ck")
    flags = TINY + MOCK + ["--save", ck, "--load", ck, "--lr-decay-iters", "10"]
    first = train(1, flags + ["--train-iters", "2"])
    assert [it for it, _ in first] == [1, 2]
    second = train(1, flags + ["--train-iters", "3"])
    assert [it for it, _ in second] == [3]


def _seeded(rank, world_size, argv):
    import random

    from megazero.training import setup
    trainer = setup(parse_args(argv, world_size=world_size))
    return trainer.topo.pp_rank, random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seed_sets_python_numpy_and_torch_per_pipeline_stage():
    """--seed 7 at PP 2: stage s seeds Python's random, numpy and torch with 7 + 100 s (Megatron's
    _set_random_seed), before anything draws from them."""
    import random
    for pp_rank, py, npy, th in run_distributed(_seeded, 2, TINY + MOCK + ["--train-iters", "4"] + layout_flags(1, 2, None, 0)):
        seed = 7 + 100 * pp_rank
        assert py == random.Random(seed).random()
        assert npy == float(np.random.RandomState(seed).rand())
        assert th == float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
