"""A checkpoint of another model is refused on every load, naming each model flag that differs
(issue 30 §3); ``--use-checkpoint-args`` takes the model flags from the checkpoint as Megatron-LM."""

import pytest

import megazero

from megazero.arguments import parse_args
from megazero.checkpoint import schema
from megazero.config import checkpoint_args
from megazero.model.saved_args import model_arg_diffs
from tests.faults.common import MOCK, TINY

BASE = TINY + MOCK + ["--tokenizer-type", "NullTokenizer", "--lr-decay-iters", "8"]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]


@pytest.fixture(scope="module")
def gelu_tanh_ck(tmp_path_factory):
    """A tiny GPT trained 2 iterations with GPT-2's tanh GELU and RMSNorm, saved at 2."""
    from megazero.training import pretrain
    save = tmp_path_factory.mktemp("modelflags") / "ck"
    argv = BASE + ["--train-iters", "2", "--save", str(save), "--save-interval", "2", "--openai-gelu",
                   "--normalization", "RMSNorm"]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 0
    return save


def test_a_default_activation_against_the_checkpoints_tanh_is_refused_before_any_work(gelu_tanh_ck, capsys):
    from megazero.training import pretrain
    argv = BASE + ["--train-iters", "4", "--load", str(gelu_tanh_ck), "--rotary-base", "500"]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 1
    err = capsys.readouterr().err
    assert (f"rank 0: checkpoint error: --load {gelu_tanh_ck} holds another model than the command line "
            "describes: --normalization: command line LayerNorm, checkpoint RMSNorm; --openai-gelu: command line "
            "False, checkpoint True; --rotary-base: command line 500.0, checkpoint 10000.0 (give the checkpoint's "
            "values, or --use-checkpoint-args to take them from it)") in err, err
    assert schema.iteration_dir(str(gelu_tanh_ck), 4) and not (gelu_tanh_ck / "iter_0000004").exists()


def test_use_checkpoint_args_resumes_with_the_model_flags_omitted(gelu_tanh_ck, tmp_path, capsys):
    from megazero.training import pretrain
    assert BASE[:len(MODEL)] == MODEL
    rest = BASE[len(MODEL):]
    argv = rest + ["--train-iters", "4", "--load", str(gelu_tanh_ck), "--use-checkpoint-args",
                   "--save", str(tmp_path / "next")]
    args = parse_args(argv, world_size=1, training=True)
    assert (args.num_layers, args.hidden_size, args.openai_gelu, args.normalization) == (2, 32, True, "RMSNorm")
    assert pretrain(args) == 0
    out = capsys.readouterr().out
    assert "iteration        4/       4" in out
    n = sum(p.numel() for p in megazero.load_model(str(gelu_tanh_ck)).gpt.parameters())  # TP 1: vocab 128 rows
    assert f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {n}\n" in out, out


def test_use_checkpoint_args_needs_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "2", "--use-checkpoint-args"], world_size=1, training=True)
    assert "--use-checkpoint-args needs --load" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "2", "--use-checkpoint-args", "--load", str(tmp_path)], world_size=1,
                   training=True)
    assert f"--use-checkpoint-args: no checkpoint under --load {tmp_path}" in capsys.readouterr().err


def test_every_model_defining_difference_is_named_and_equal_values_pass():
    saved = {"swiglu": True, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
             "num_query_groups": 2, "position_embedding_type": "rope", "max_position_embeddings": 64,
             "apply_layernorm_1p": False, "norm_epsilon": 1e-6, "rotary_base": 10000}
    now = dict(saved, swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False,
               num_query_groups=4, max_position_embeddings=128, apply_layernorm_1p=True, rotary_base=10000.0)
    assert model_arg_diffs(saved, now) == [
        "--num-query-groups (--group-query-attention): command line 4, checkpoint 2",
        "--swiglu: command line False, checkpoint True",
        "--disable-bias-linear (add_bias_linear): command line True, checkpoint False",
        "--untie-embeddings-and-output-weights: command line False, checkpoint True",
        "--apply-layernorm-1p: command line True, checkpoint False"]
    assert model_arg_diffs(saved, saved) == []


def test_the_arguments_package_reads_the_checkpoint_format_by_its_names():
    assert checkpoint_args.POINTER == schema.LATEST
    assert checkpoint_args.METADATA.format(5) == f"{schema.ITERATION_PREFIX}0000005/{schema.METADATA}"


def test_a_same_layout_load_that_recuts_zero_shards_says_loaded(gelu_tanh_ck, tmp_path, capsys):
    from megazero.training import pretrain
    argv = BASE + ["--train-iters", "3", "--load", str(gelu_tanh_ck), "--openai-gelu", "--normalization", "RMSNorm",
                   "--zero-reduce-bucket-size", "5000", "--save", str(tmp_path / "next")]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 0
    out = capsys.readouterr().out
    assert f"loaded {gelu_tanh_ck}/iter_0000002 in the layout it was saved in (" in out, out
    assert "resharded" not in out
