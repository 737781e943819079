"""Flags, DeepSpeed-config merging, validation rules (status 2, one line) and derived values."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazero.arguments import parse_args
from megazero.model.config import pad_vocab_size
from megazero.training.build import build_configs

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "16"]


def parse(extra, world_size=8, base=BASE):
    return parse_args(base + list(extra), world_size=world_size, prog="pretrain_gpt.py")


def fails(capsys, extra, *needles, world_size=8, base=BASE):
    with pytest.raises(SystemExit) as exc:
        parse(extra, world_size, base)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pretrain_gpt.py: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_derived_values():
    a = parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1", "--vocab-size", "1000", "--bf16"])
    assert a.data_parallel_size == 2 and a.num_micro_batches == 4
    assert a.virtual_pipeline_model_parallel_size == 2
    model = build_configs(a).model  # the model's derived sizes live in the frozen GPTConfig
    assert model.padded_vocab(2) == 1024 and pad_vocab_size(50257, 128, 8) == 51200
    assert a.params_dtype == torch.bfloat16 and a.accumulate_allreduce_grads_in_fp32
    assert model.ffn_hidden_size == 256 and model.kv_channels == 16 and model.num_query_groups == 4
    assert model.max_position_embeddings == 32 and a.lr_decay_iters is None
    assert build_configs(parse(["--swiglu", "--hidden-size", "384", "--vocab-size", "10"])).model.ffn_hidden_size == 1024
    assert parse(["--fp16"]).params_dtype == torch.float16
    assert parse([]).params_dtype == torch.float32


def test_arguments_are_frozen_after_validation():
    a = parse(["--vocab-size", "1000"])
    with pytest.raises(AttributeError, match="frozen"):
        a.vocab_size = 5
    b = a.replace(save="/tmp/x")
    assert b.save == "/tmp/x" and a.save is None
    with pytest.raises(AttributeError, match="frozen"):
        b.save = None


@pytest.mark.parametrize("extra,world,needles", [
    (["--tensor-model-parallel-size", "3"], 8, ["world size 8", "--tensor-model-parallel-size 3"]),
    (["--tensor-model-parallel-size", "8", "--hidden-size", "60"], 8, ["--hidden-size 60", "8"]),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 8,
     ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    (["--group-query-attention", "--num-query-groups", "3"], 8, ["--num-attention-heads 4", "--num-query-groups 3"]),
    (["--num-query-groups", "2"], 8, ["--num-query-groups 2 needs --group-query-attention"]),
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 8,
     ["--num-query-groups 1", "--tensor-model-parallel-size 2"]),
    (["--pipeline-model-parallel-size", "8", "--global-batch-size", "2"], 8,
     ["--num-layers 4", "--pipeline-model-parallel-size 8"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 8,
     ["--num-layers 4", "--num-layers-per-virtual-pipeline-stage 3"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 8, ["--pipeline-model-parallel-size > 1"]),
    (["--global-batch-size", "12"], 8, ["--global-batch-size 12", "--micro-batch-size 2", "8"]),
    (["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "12"], 8, ["number of micro-batches 3", "--pipeline-model-parallel-size 4"]),
    (["--fp16", "--bf16"], 8, ["--fp16", "--bf16"]),
    (["--max-position-embeddings", "16"], 8, ["--seq-length 32", "--max-position-embeddings 16"]),
    (["--zero-stage", "4"], 8, ["--zero-stage", "4"]),
    (["--zero-reduce-bucket-size", "-5"], 8, ["--zero-reduce-bucket-size", "-5"]),
    (["--zero-max-live-parameters", "-1"], 8, ["--zero-max-live-parameters"]),
    (["--load", "/etc/hostname"], 8, ["--load /etc/hostname is not a directory"]),
    (["--tokenizer-type", "BertTokenizer"], 8, ["--tokenizer-type", "BertTokenizer"]),
    (["--recompute-method", "uniform"], 8, ["--recompute-method", "--recompute-granularity full"]),
    (["--group-query-attention"], 8, ["--group-query-attention", "--num-query-groups"]),
    (["--micro-batch-size", "0"], 8, ["--micro-batch-size must be >= 1, got 0"]),
    (["--tensor-model-parallel-size", "0"], 8, ["--tensor-model-parallel-size must be >= 1"]),
])
def test_validation_rules(capsys, extra, world, needles):
    fails(capsys, extra, *needles, world_size=world)


def test_sequence_parallel_without_tp_warns_and_turns_off():
    with pytest.warns(UserWarning, match="--sequence-parallel"):
        a = parse(["--sequence-parallel"])
    assert a.sequence_parallel is False
    assert parse(["--sequence-parallel", "--tensor-model-parallel-size", "2"]).sequence_parallel


def test_rope_allows_long_sequences():
    assert parse(["--max-position-embeddings", "16", "--position-embedding-type", "rope"]).seq_length == 32


def test_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args(BASE).data_parallel_size == 4


def test_help_lists_groups_and_validation_exits_cleanly():
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for group in ("network size", "regularization", "training", "initialization", "learning rate",
                  "checkpointing", "mixed precision", "distributed", "ZeRO", "validation", "data", "logging",
                  "mixture of experts"):
        assert f"\n{group}" in out.stdout, group
    bad = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--tensor-model-parallel-size", "3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"WORLD_SIZE": "8", "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: world size 8")


@pytest.mark.parametrize("drop, message", [
    (["--train-iters", "3"], "one of --train-iters or --train-samples is required"),
    (["--lr", "0.1"], "--lr is required"),
    (["--seq-length", "32"], "--seq-length is required"),
])
def test_training_run_without_a_required_value_is_an_argparse_error(drop, message):
    """pretrain_gpt.py (training=True): a missing value is one 'prog: error:' line, never a TypeError."""
    argv = BASE + ["--train-iters", "3", "--lr", "0.1"]
    i = argv.index(drop[0])
    argv = argv[:i] + argv[i + len(drop):]
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={"WORLD_SIZE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"pretrain_gpt.py: error: {message}")


def test_megatron_flag_classes():
    """Class 2: accepted and dropped from the namespace; class 3 at Megatron's default: accepted;
    class 3 otherwise: one error naming it; both iteration and sample lengths: an error."""
    args = parse_args(BASE + ["--use-mcore-models", "--num-workers", "4", "--context-parallel-size", "1",
                              "--use-distributed-optimizer", "--split", "'99,1,0'"], world_size=8)
    assert args.megatron_no_effect == ("--use-mcore-models",) and args.zero_stage == 1
    assert args.num_workers == 4  # honoured: micro-batches read ahead on a background thread (training/data.py)
    assert args.split == "99,1,0" and not any(k.startswith("megatron:") for k in vars(args))
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--context-parallel-size", "2", "--fp8-format", "hybrid"], world_size=8)
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "3", "--train-samples", "48"], world_size=8)


@pytest.mark.parametrize("extra,message", [
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
])
def test_impossible_values_are_named(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--mock-data", "--vocab-size", "100", "--train-iters", "2", "--lr", "0.1"] + extra,
                   world_size=8, prog="pretrain_gpt.py")
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_training_run_without_data_is_an_error_and_save_interval_without_save_warns(capsys):
    argv = BASE + ["--train-iters", "2", "--lr", "0.1"]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=8, prog="pretrain_gpt.py", training=True)
    assert "no training data" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="--save-interval 5 without --save"):
        parse_args(argv + ["--mock-data", "--vocab-size", "100", "--save-interval", "5"], world_size=8,
                   prog="pretrain_gpt.py", training=True)
