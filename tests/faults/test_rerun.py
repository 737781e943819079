"""NaN/Inf, spikes and large gradients, each injected, through Megatron-LM's rerun state machine
(issue 46, items 1-2; docs/reliability.md): a persistent fault stops with exit 17 and saves
nothing after it, a transient one continues with the fault-free losses, ``report_stats`` only
reports, ``--no-check-for-nan-in-loss-and-grad`` keeps the old skip, fp16's loss scaler still
skips its overflows. Real faults come from ``MEGAZERO_FAULTS`` (megazero/training/faults.py),
Megatron's rejected results from ``--error-injection-rate``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "3", "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--train-iters", "4"]


def _runs(rank, world, scenarios):
    """Each ``(faults, argv)`` trained in turn on this rank: ``(exit code, logged history, skipped)``."""
    from megazero.training import setup
    out = []
    for faults, argv in scenarios:
        os.environ["MEGAZERO_FAULTS"] = faults
        trainer = setup(parse_args(TINY + argv, world_size=world))
        code = trainer.train(None)
        trainer.optimizer.close()
        out.append((code, trainer.history, trainer.skipped))
    os.environ.pop("MEGAZERO_FAULTS")
    return out


def last_rank(world, *scenarios):
    """The last rank's results (it owns the loss); every rank must exit alike."""
    results = run_distributed(_runs, world, list(scenarios), timeout_s=300)
    assert all([r[0] for r in rank] == [r[0] for r in results[-1]] for rank in results), results
    return results[-1]


def losses(history):
    return [loss for _, loss in history]


def test_persistent_nan_gradient_stops_with_17_and_saves_nothing_after_it(tmp_path, capfd):
    ck = tmp_path / "ck"
    (code, history, _), = last_rank(2, ("nan_grad:rank=1:iteration=3", ["--save", str(ck), "--save-interval", "1"]))
    out = capfd.readouterr().out
    assert code == 17 and [i for i, _ in history] == [1, 2]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert ("Unexpected result nan on rank 1 at iteration #3 invocation #1 (message='found NaN in local grad norm "
            "for bucket #0 in backward pass before data-parallel communication collective')") in out
    assert "Need to rerun step to check reproducibility of initial result" in out
    assert ("Rank 1, node " in out and "iteration #3: First rerun: unexpected result is reproducible within the "
            "tolerance (nan = nan)") in out
    assert "Exiting now. The job can be resumed from a previous checkpoint" in out


def test_transient_nan_gradient_continues_with_the_fault_free_losses(tmp_path, capfd):
    clean, transient, exits, moves = last_rank(
        2, ("", []), ("nan_grad:rank=1:iteration=2:runs=1", []),
        ("nan_grad:rank=1:iteration=2:runs=1", ["--rerun-on-transient-error", "exit"]),
        ("nan_grad:rank=1:iteration=2:runs=1", ["--rerun-on-transient-error", "checkpoint_and_exit",
                                                "--save", str(tmp_path / "ck")]))
    out = capfd.readouterr().out
    assert clean[0] == 0 and len(clean[1]) == 4
    assert transient[0] == 0 and losses(transient[1]) == losses(clean[1]), "a transient fault changed the run"
    assert "iteration #2: First rerun: unexpected result is not reproducible within the tolerance" in out
    assert "iteration #2: Possible transient error!!" in out and "a transient fault (rank 1: NaN gradient)" in out
    assert exits[0] == 17 and [i for i, _ in exits[1]] == [1]
    assert moves[0] == 16 and losses(moves[1]) == losses(clean[1])[:2]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


LAYOUTS = [["--pipeline-model-parallel-size", "2"],
           ["--zero-stage", "3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
           ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear"]]


def test_a_transient_fault_is_exact_under_pp_zero3_dropout_and_moe(capfd):
    """The re-run restores what the first run changed: p2p schedule, stage-3 gathers, dropout RNG,
    the MoE expert counts and metrics."""
    results = last_rank(2, *[(faults, argv) for argv in LAYOUTS for faults in ("", "nan_grad:rank=1:iteration=2:runs=1")])
    for argv, clean, transient in zip(LAYOUTS, results[0::2], results[1::2]):
        assert clean[0] == transient[0] == 0 and len(clean[1]) == 4, argv
        assert losses(transient[1]) == losses(clean[1]), argv
    assert capfd.readouterr().out.count("> iteration 2: a transient fault (") == len(LAYOUTS), "each was re-run"


def test_megatron_error_injection_transient_and_persistent(capfd):
    clean, transient, persistent = last_rank(
        2, ("", []), ("", ["--error-injection-rate", "1"]),
        ("", ["--error-injection-rate", "1", "--error-injection-type", "persistent_error"]))
    out = capfd.readouterr().out
    assert transient[0] == 0 and losses(transient[1]) == losses(clean[1])
    assert "Injecting error type Transient error" in out and "Injecting error type Persistent error" in out
    assert persistent[0] == 17 and [i for i, _ in persistent[1]] == [1], "nothing is injected in iteration 1"


def test_report_stats_reports_and_no_check_keeps_the_old_skip(capfd):
    report, disabled, unchecked = last_rank(
        2, ("nan_loss:rank=1:iteration=2", ["--rerun-mode", "report_stats"]),
        ("nan_loss:rank=1:iteration=2", ["--rerun-mode", "disabled"]),
        ("nan_loss:rank=1:iteration=2", ["--no-check-for-nan-in-loss-and-grad"]))
    out = capfd.readouterr().out
    assert report[0] == 0 and report[2] == 1 and [i for i, _ in report[1]] == [1, 2, 3, 4]
    assert "Stats on computation determinism in validation calls" in out
    assert "Unexpected result nan on rank 1 at iteration #2 invocation #1" in out
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in out
    assert disabled[0] == 1 and "Rank 1, node " in out and (
        "iteration 2: Unexpected result nan (message='found NaN in local forward loss calculation')") in out
    assert unchecked[0] == 0 and unchecked[2] == 1, "--no-check-for-nan-in-loss-and-grad: skipped and goes on"


SPIKY = ["--global-batch-size", "16", "--train-iters", "9", "--check-for-spiky-loss", "--check-for-large-grads",
         "--zero-stage", "2"]


def test_spiky_loss_and_large_grads_rerun_and_continue(capfd):
    """16 micro-batches per iteration: the first 100 losses (6 1/4 iterations) are the samples."""
    clean, spike, spike_again, large = last_rank(
        1, ("", SPIKY), ("spike_loss:iteration=8:runs=1", SPIKY), ("spike_loss:iteration=8", SPIKY),
        ("large_grad:iteration=9:runs=1", SPIKY))
    out = capfd.readouterr().out
    assert spike[0] == 0 and losses(spike[1]) == losses(clean[1])
    assert "Unexpected result 4190.7" in out and "at iteration #8 invocation #1 (message='Spiky loss')" in out
    assert spike_again[0] == 0 and losses(spike_again[1])[7] > 100 * losses(clean[1])[7]
    assert "Continuing normal execution because failed validation was not fatal" in out
    assert large[0] == 0 and losses(large[1]) == losses(clean[1])
    assert "at iteration #9 invocation #1 (message='found unexpected large grads in bucket #" in out


def test_the_spike_rule_and_the_comparison_are_megatron_s():
    """``is_unexpectedly_large``: the first 100 finite |values| are samples (NaN/Inf skipped),
    then ``>= 10 x`` their maximum is flagged; ``_compare_floats``: NaN equals NaN, one-sided
    NaN/Inf is inf, else the relative difference."""
    import torch
    from megazero.training.result_checks import RunningMax, compare, compare_floats
    spikes = RunningMax("cpu").flags(torch.tensor([1.0] * 99 + [float("nan"), 2.0, 19.9, 20.0, -25.0, float("inf")]))
    assert spikes.tolist() == [False] * 102 + [True, True, False]
    nan, inf = float("nan"), float("inf")
    for a, b, want in [(nan, nan, 0.0), (nan, 1.0, inf), (1.0, inf, inf), (inf, inf, 0.0), (2.0, 1.0, 2 / 3),
                       (1.0, -1.0, inf)]:
        assert compare_floats(a, b) == pytest.approx(want) and compare(a, torch.tensor(b)).item() == pytest.approx(want)


def test_fp16_dynamic_loss_scaling_turns_the_nan_check_off_and_still_skips_overflows(capfd):
    fp16 = ["--fp16", "--initial-loss-scale", "1e30", "--train-iters", "3"]
    with pytest.warns(UserWarning, match="dynamic loss scaling is being used"):
        args = parse_args(TINY + fp16, world_size=1)
    assert args.check_for_nan_in_loss_and_grad is False
    assert parse_args(TINY + ["--fp16", "--loss-scale", "128"], world_size=1).check_for_nan_in_loss_and_grad
    (code, history, skipped), = last_rank(1, ("", fp16))
    assert code == 0 and skipped >= 1, "the loss scaler's overflow steps are skipped, not NaN faults"


@pytest.mark.parametrize("argv,line", [
    (["--error-injection-rate", "-1"], "--error-injection-rate must be >= 0, got -1"),
    (["--error-injection-rate", "5", "--rerun-mode", "disabled"],
     "--error-injection-rate 5 needs --rerun-mode validate_results"),
    (["--error-injection-rate", "5", "--no-check-for-nan-in-loss-and-grad"], "has no result validation to inject"),
    (["--rerun-on-transient-error", "checkpoint_and_exit"], "checkpoint_and_exit needs --save"),
    (["--rerun-on-transient-error", "exit", "--rerun-mode", "report_stats"], "exit needs --rerun-mode validate_results"),
    (["--straggler-ctrlr-port", "70000"], "--straggler-ctrlr-port must be a TCP port in [1, 65535], got 70000"),
    (["--straggler-minmax-count", "0", "--log-straggler"], "--straggler-minmax-count must be >= 1, got 0"),
])
def test_bad_rerun_and_injection_flags_are_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(TINY + argv, world_size=1, prog="pretrain_gpt.py")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and line in err[0], err


def test_an_injection_type_outside_megatron_s_choices_is_argparse_s_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(TINY + ["--error-injection-type", "flaky"], world_size=1, prog="pretrain_gpt.py")
    assert e.value.code == 2 and "argument --error-injection-type: invalid choice: 'flaky'" in capsys.readouterr().err


def test_issue_example_lr_1e30_stops_with_17(tmp_path):
    """The issue's example, a real NaN through pretrain_gpt.py: before, a skipped iteration and exit 0."""
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--lr", "1e30", "--train-iters", "6"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 17, run.stdout[-2000:] + run.stderr[-2000:]
    assert "First rerun: unexpected result is reproducible within the tolerance (nan = nan)" in run.stdout
    assert "Exiting now. The job can be resumed from a previous checkpoint" in run.stdout
