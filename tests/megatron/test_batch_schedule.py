"""BatchSchedule against hand-worked values of Megatron-LM's formulas, and against a literal
transcription of Megatron's calculators and ``update_train_iters`` loops:
ramp-up: core_v0.17.1 ``RampupBatchsizeNumMicroBatchesCalculator.update`` and ``update_train_iters``;
step schedule: core_v0.19.0 ``StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples``
and ``update_train_iters``."""

from types import SimpleNamespace

import pytest

from megazero.arguments import parse_args
from megazero.config.batch_schedule import BatchSchedule, parse_batch_schedule
from megazero.optim.lr_schedule import LRScheduler

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "10",
        "--micro-batch-size", "1", "--mock-data", "--vocab-size", "64", "--lr", "0.1"]


def ramp(start=2, incr=2, samples=100, final=8, mbs=1, dp=2):
    return BatchSchedule(micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=final,
                         rampup=(start, incr, samples), flag="--rampup-batch-size")


def megatron_rampup_size(c, start, incr, samples, final):
    """core_v0.17.1 RampupBatchsizeNumMicroBatchesCalculator.update, literally."""
    per_increment = samples / ((final - start) // incr)
    if c > samples:
        return final
    return start + int(c / per_increment) * incr


def megatron_rampup_train_iters(train_samples, start, incr, samples, final):
    """core_v0.17.1 update_train_iters with a ramp-up, literally."""
    iterations = consumed = 0
    while consumed <= samples and consumed <= train_samples:
        consumed += megatron_rampup_size(consumed, start, incr, samples, final)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // final
    return iterations


def megatron_step_train_iters(train_samples, schedule):
    """core_v0.19.0 update_train_iters with a step schedule, literally."""
    def size(c):
        b = schedule[0][1]
        for t, bs in schedule:
            if c >= t:
                b = bs
            else:
                break
        return b
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += size(consumed)
        iterations += 1
    return iterations


def test_rampup_sizes_by_hand():
    """S=2, I=2, R=100, G=8: n = 3 increments of r = 100/3 = 33.33 samples; B = 2 + int(c / r) * 2."""
    s = ramp()
    assert [s.global_batch_size(c) for c in (0, 33, 34, 66, 67, 99, 100, 101, 10 ** 9)] == [2, 2, 4, 4, 6, 6, 8, 8, 8]
    assert [s.num_micro_batches(c) for c in (0, 34, 70, 100)] == [1, 2, 3, 4]  # B / (mbs 1 x DP 2)
    # iterations: 17 x 2 (c 0 -> 34), 9 x 4 (-> 70), 5 x 6 (-> 100), then 8 (c = 100 <= R is ramp formula's 3 x 2 + 2)
    assert list(s.stretches(40)) == [(0, 2, 17), (34, 4, 9), (70, 6, 5), (100, 8, 9)]
    assert s.consumed_after(40) == 100 + 9 * 8 and s.consumed_after(5, consumed_samples=34) == 54


def test_rampup_train_iters_by_hand_and_as_megatron():
    s = ramp()
    # T=150: 31 ramp iterations reach c=100 (<= R), one more at 8 -> 108 (32); then (150 - 108) // 8 = 5 -> 37
    # T=100: the loop still runs at c=100 -> 108 samples, 32 iterations (Megatron overshoots T)
    # T=40: 17 iterations to 34, then 38, 42 (c=42 > 40 stops) -> 19
    assert [s.train_iters(t) for t in (150, 100, 40)] == [37, 32, 19]
    for args in [(2, 2, 100, 8), (16, 16, 5859375, 1536), (3, 5, 77, 48), (8, 8, 1000, 64)]:
        sched = ramp(*args)
        for t in (1, 50, 77, 99, 100, 101, 1000, 12345, 7_000_000):
            assert sched.train_iters(t) == megatron_rampup_train_iters(t, *args), (args, t)
        for c in range(0, 1200, 7):
            assert sched.global_batch_size(c) == megatron_rampup_size(c, *args)


def test_step_schedule_by_hand_and_as_megatron():
    """'0:4 1K:8 2K:16' tokens at seq 10 -> thresholds 0, 100, 200 samples. T=300: 25 x 4 (-> 100),
    13 x 8 (-> 204: after 12, c = 196 < 200), 6 x 16 (-> 300): 44 iterations."""
    steps = parse_batch_schedule("'0:4 1K:8 2K:16'", seq_length=10)
    assert steps == [(0, 4), (100, 8), (200, 16)]
    s = BatchSchedule(micro_batch_size=2, data_parallel_size=2, global_batch_size=16, steps=steps,
                      flag="--step-batch-size-schedule")
    assert [s.global_batch_size(c) for c in (0, 99, 100, 199, 200)] == [4, 4, 8, 8, 16]
    assert s.num_micro_batches(150) == 2 and s.train_iters(300) == 44 and s.consumed_after(44) == 300
    assert list(s.stretches(44)) == [(0, 4, 25), (100, 8, 13), (204, 16, 6)]
    for t in (1, 3, 99, 100, 101, 203, 204, 205, 1000):
        assert s.train_iters(t) == megatron_step_train_iters(t, steps)
    assert parse_batch_schedule("0:768 250B:1536", seq_length=2048) == [(0, 768), (250 * 10 ** 9 // 2048, 1536)]


def test_constant_and_from_args():
    args = SimpleNamespace(micro_batch_size=2, data_parallel_size=4, global_batch_size=None,
                           step_batch_size_schedule=None, rampup_batch_size=None, seq_length=10)
    s = BatchSchedule.from_args(args)
    assert s.global_batch_size(12345) == 8 and s.num_micro_batches(0) == 1 and s.train_iters(100) == 12
    assert not s.varies and s.describe() == "> constant global batch size 8"
    r = BatchSchedule.from_args(SimpleNamespace(**{**vars(args), "global_batch_size": 64,
                                                   "rampup_batch_size": ["16", "16", "1000"]}))
    assert r.varies and r.global_batch_size(0) == 16 and r.global_batch_size(1001) == 64
    assert "honoured as in Megatron-LM core_v0.17.1" in r.describe() and "16 to 64 in steps of 16" in r.describe()


def test_bad_schedules_name_the_flag():
    with pytest.raises(ValueError, match="--rampup-batch-size 16 10 100: --global-batch-size 64 - start 16"):
        ramp(16, 10, 100, 64)
    with pytest.raises(ValueError, match="must be >= 1"):
        ramp(2, 2, 0, 8)
    steps = parse_batch_schedule("0:4 1K:6", seq_length=10)
    s = BatchSchedule(micro_batch_size=1, data_parallel_size=4, global_batch_size=6, steps=steps,
                      flag="--step-batch-size-schedule")
    s.check(25)  # 25 iterations of 4 never reach sample 100
    with pytest.raises(ValueError, match=r"--step-batch-size-schedule gives a global batch size of 6 at sample 100, "
                                         r"not divisible by --micro-batch-size 1 x data-parallel size 4 = 4"):
        s.check(26)
    with pytest.raises(ValueError, match="with interleaving not a multiple of --pipeline-model-parallel-size 2"):
        ramp(2, 1, 100, 4, mbs=1, dp=1).check(40, pipeline_parallel=2, interleaved=True)  # 3 micro-batches
    with pytest.raises(ValueError, match="threshold 0"):
        parse_batch_schedule("10:4", None)


def test_lr_advances_by_the_current_batch_size():
    """Megatron's train_step: each applied step advances the schedule by B(c), so the rate at
    iteration start is the formula at the consumed samples."""
    s, lr = ramp(), LRScheduler(1.0, min_lr=0.0, warmup_iters=50, decay_iters=300, decay_style="linear")
    c = 0
    for _ in range(40):
        assert lr.get_lr() == lr.get_lr(c)
        b = s.global_batch_size(c)
        lr.step(b)
        c += b
    assert lr.num_steps == c == s.consumed_after(40)


def test_validation(capsys):
    args = parse_args(BASE + ["--train-samples", "300", "--step-batch-size-schedule", "0:4 1K:8"], world_size=2)
    assert args.train_iters == 25 + 25 and args.global_batch_size == 2  # Megatron's default micro x DP (eval)
    args = parse_args(BASE + ["--train-samples", "40", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24"],
                      world_size=2)
    assert args.train_iters == 9 and "ramp-up honoured as in Megatron-LM core_v0.17.1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "10", "--rampup-batch-size", "2", "2", "100"], world_size=2)
    assert "--rampup-batch-size takes START INCREMENT SAMPLES, needs --train-samples" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-samples", "400", "--step-batch-size-schedule", "0:4 1K:6"], world_size=4)
    assert "--step-batch-size-schedule gives a global batch size of 6 at sample 100" in capsys.readouterr().err


def test_sample_counts_as_megatron():
    """get_train_valid_test_num_samples: train = --train-samples (or iters x B), raised to what the
    schedule consumes; valid = (iters // eval_interval + 1) x eval_iters x B; test = eval_iters x B."""
    from megazero.config.configs import LRConfig, ScheduleConfig
    from megazero.training.data import sample_counts

    def schedule(a):  # the ScheduleConfig of a namespace holding only what sample_counts reads
        return ScheduleConfig(train_iters=a.train_iters, batches=BatchSchedule.from_args(a),
                              global_batch_size=a.global_batch_size, num_micro_batches=1, lr=LRConfig(None),
                              train_samples=a.train_samples, eval_iters=a.eval_iters, eval_interval=a.eval_interval)
    args = SimpleNamespace(micro_batch_size=1, data_parallel_size=2, global_batch_size=8, step_batch_size_schedule=None,
                           rampup_batch_size=None, seq_length=10, train_samples=100, train_iters=12,
                           eval_interval=5, eval_iters=2)
    assert sample_counts(schedule(args)) == (100, 3 * 2 * 8, 16)  # 12 iterations of 8 use 96 of Megatron's 100
    ramped = SimpleNamespace(**{**vars(args), "rampup_batch_size": [2, 2, 100], "train_iters": 32})
    assert sample_counts(schedule(ramped))[0] == 108  # the ramp's last iteration (c = 100 <= R) passes T, as Megatron's loop
    stepped = SimpleNamespace(**{**vars(args), "train_samples": None, "train_iters": 30, "global_batch_size": 4,
                                 "step_batch_size_schedule": "0:4 1K:16"})
    assert sample_counts(schedule(stepped))[0] == 25 * 4 + 5 * 16  # > Megatron's count 30 x 4


@pytest.mark.parametrize("extra,flags,count", [
    (["--step-batch-size-schedule", "0:4 40:1000000000000", "--train-iters", "2"],
     "--step-batch-size-schedule '0:4 40:1000000000000' with --train-iters 2", 1_000_000_000_004),
    (["--train-samples", "1000000000000"], "--train-samples 1000000000000", 1_000_000_000_000),
    (["--train-iters", "1000000000000", "--global-batch-size", "4"],
     "--train-iters 1000000000000 x --global-batch-size 4", 4_000_000_000_000)])
def test_sample_counts_that_cannot_be_indexed_are_refused_before_any_process_group(extra, flags, count, capsys):
    """Issue 41: a 10^12-sample batch ended in numpy's 'MemoryError: Unable to allocate 4.72 TiB'
    while the dataset index was built, naming no flag; now the flag check refuses it in one line."""
    import torch.distributed as dist
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--eval-iters", "0"] + extra, world_size=1, training=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and not dist.is_initialized()
    assert lines[0].split(": error: ", 1)[1].startswith(
        f"{flags} makes the run draw {count} training samples, more than can be indexed: a dataset index takes 24 "
        f"bytes a sample ({count * 24 / 2**40:.3g} TiB), this host has "), lines[0]


def test_the_sample_count_bound_is_the_index_that_fits_the_hosts_memory():
    """At most memory // 24 samples: 1000 with 24000 bytes, for training and for validation."""
    from megazero.config.run_checks import check_sample_counts

    def problems(*extra):
        found = []
        check_sample_counts(found.append, parse_args(BASE + ["--global-batch-size", "8"] + list(extra), world_size=1),
                            memory_bytes=24_000)
        return found
    assert problems("--train-iters", "125", "--eval-iters", "0") == []
    assert problems("--train-iters", "126", "--eval-iters", "0") == [
        "--train-iters 126 x --global-batch-size 8 makes the run draw 1008 training samples, more than can be "
        "indexed: a dataset index takes 24 bytes a sample (2.2e-08 TiB), this host has 0.0 GiB of memory (at most "
        "1000 samples): lower it"]
    assert problems("--train-iters", "10", "--eval-iters", "70", "--eval-interval", "5")[0].startswith(
        "--eval-iters 70 x 3 evaluations (--eval-interval 5) x --global-batch-size 8 makes the run draw 1680 "
        "validation samples")
