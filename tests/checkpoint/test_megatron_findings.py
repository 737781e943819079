"""The Megatron findings of issue 29, checked without Megatron installed (tests/peers/ checks the
same against megatron-core 0.16.1 itself):

* a Megatron-LM 0.16 rank file (``args.exit_signal`` a ``signal.Signals``, numpy's RNG state in
  ``rng_state``) loads under ``weights_only``; any other global is still refused, unrun;
* ``--openai-gelu`` is read for legacy (``language_model.*``) checkpoints only; an mcore model's
  gelu is the tanh one exactly when the bias-gelu fusion runs;
* the legacy model's RoPE base is 10000 whatever ``--rotary-base`` says;
* ``from-hf`` prints the HF config's dropouts as the flags to train with.
"""
import json
import os
import signal

import pytest
import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

from megazero.checkpoint.convert.megatron import MegatronCheckpoint, config_from_megatron_args, load_megatron_file
from megazero.checkpoint.schema import CheckpointError
from tests.checkpoint.megatron_format import write_megatron_checkpoint
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_megatron_import import GPT2ISH, LLAMAISH, converted_model, direct_model, logits_of

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def test_megatron_016_rank_file_loads(tmp_path):
    model = direct_model(GPT2ISH)
    src = write_megatron_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, 1, 1)
    path = str(tmp_path / "mt" / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt")
    unsafe = set(get_unsafe_globals_in_checkpoint(path))
    assert {"signal.Signals", "numpy.ndarray", "numpy.dtype"} <= unsafe  # what Megatron 0.16 pickles
    state = load_megatron_file(path)
    assert state["args"].exit_signal == signal.SIGTERM and isinstance(state["args"].exit_signal, signal.Signals)
    assert state["rng_state"][0]["np_rng_state"][1].dtype.name == "uint32"
    with MegatronCheckpoint(src, vocab_size=100) as ckpt:
        assert ckpt.args["exit_signal"] == signal.SIGTERM


class Arbitrary:
    def __reduce__(self):
        return (os.getcwd, ())


def test_arbitrary_globals_still_refused(tmp_path):
    for i, bad in enumerate([Arbitrary(), Arbitrary, json.JSONDecoder]):
        path = str(tmp_path / f"bad{i}.pt")
        torch.save({"args": None, "model": {}, "extra": bad}, path)
        with pytest.raises(CheckpointError, match="refusing to unpickle"):
            load_megatron_file(path)


BASE_ARGS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                 padded_vocab_size=128, position_embedding_type="rope", rotary_base=500000)


@pytest.mark.parametrize("family,extra,activation", [
    ("mcore", dict(openai_gelu=True, bias_gelu_fusion=False), "gelu"),  # the flag is ignored by mcore
    ("mcore", dict(openai_gelu=False), "gelu_tanh"),  # default fused bias-gelu: tanh approximation
    ("mcore", dict(openai_gelu=True, add_bias_linear=False, bias_gelu_fusion=True), "gelu"),
    ("mcore", dict(openai_gelu=True, swiglu=True), "swiglu"),
    ("legacy", dict(openai_gelu=True, bias_gelu_fusion=False), "gelu_tanh"),
    ("legacy", dict(openai_gelu=False, bias_gelu_fusion=True), "gelu"),
    ("legacy", dict(swiglu=True), "swiglu"),
])
def test_activation_per_family(family, extra, activation):
    config = config_from_megatron_args({**BASE_ARGS, **extra}, family=family)
    assert config.activation == activation
    assert config.rotary_base == (10000.0 if family == "legacy" else 500000.0)


def test_legacy_swiglu_with_openai_gelu_refused():
    with pytest.raises(CheckpointError, match="openai-gelu"):
        config_from_megatron_args({**BASE_ARGS, "swiglu": True, "openai_gelu": True}, family="legacy")


def test_mcore_checkpoint_with_openai_gelu_gives_exact_gelu_logits(tmp_path):
    exact = dict(GPT2ISH, activation="gelu")
    model = direct_model(exact)
    src = write_megatron_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, 2, 2,
                                    family="mcore", openai_gelu=True, bias_gelu_fusion=False)
    assert tool().main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz"), "--vocab-size", "100"]) == 0
    ours, _ = converted_model(str(tmp_path / "mz"))
    assert ours.config.activation == "gelu"
    torch.testing.assert_close(logits_of(ours, IDS), logits_of(model, IDS), rtol=0, atol=0)


@pytest.mark.parametrize("family,base", [("legacy", 10000.0), ("mcore", 500000.0)])
def test_rotary_base_as_each_family_applies_it(tmp_path, family, base):
    model = direct_model(dict(LLAMAISH, rotary_base=base))
    src = write_megatron_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, 1, 2,
                                    family=family, rotary_base=500000)
    assert tool().main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz"), "--vocab-size", "100"]) == 0
    ours, _ = converted_model(str(tmp_path / "mz"))
    assert ours.config.rotary_base == base
    torch.testing.assert_close(logits_of(ours, IDS), logits_of(model, IDS), rtol=0, atol=0)


@pytest.mark.parametrize("style,cfg,flags", [
    ("gpt2", dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), "--attention-dropout 0 --hidden-dropout 0"),
    ("gpt2", dict(attn_pdrop=0.05, resid_pdrop=0.2, embd_pdrop=0.2), "--attention-dropout 0.05 --hidden-dropout 0.2"),
    ("llama", dict(attention_dropout=0.0), "--attention-dropout 0 --hidden-dropout 0"),
])
def test_from_hf_prints_the_models_dropouts(tmp_path, capsys, style, cfg, flags):
    import transformers
    if style == "gpt2":
        hf = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, **cfg)
        net = transformers.GPT2LMHeadModel(hf)
    else:
        hf = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                      intermediate_size=24, vocab_size=50, max_position_embeddings=16, **cfg)
        net = transformers.LlamaForCausalLM(hf)
    net.save_pretrained(str(tmp_path / "hf"))
    assert tool().main(["from-hf", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "mz")]) == 0
    assert flags in capsys.readouterr().out
