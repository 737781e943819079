"""Megazero models loaded from random-initialized HF GPT-2 / Llama / Qwen2 (untied and tied) give
transformers' logits.

fp32, max |a - b| / max |b| <= 1e-5, at TP = 1 and TP = 2; weights load from memory, from a saved
folder (safetensors and pytorch_model.bin) and convert back unchanged; Qwen2 greedy-decodes as
transformers' ``generate`` at TP 1 and 2 and its exported config.json rebuilds the same model.
Skips without transformers.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megazero.model import GPTModel  # noqa: E402
from megazero.checkpoint.convert.hf import (arch_of_config, config_from_hf, hf_config_of, load_hf,  # noqa: E402
                                            read_hf_folder, to_hf_state_dict)
from megazero.inference.generation import generate  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402
from megazero.parallel.topology import Topology  # noqa: E402

VOCAB, NEW = 100, 10


def _hf_models():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    models = {}
    for name, model in (("gpt2", gpt2), ("llama", llama), ("qwen2", qwen2(tie=False)), ("qwen2 tied", qwen2(tie=True))):
        with torch.no_grad():  # make biases and norms non-trivial too
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.eval()
        models[name] = model
    return models


def qwen2(tie: bool, seed: int = 0):
    """Qwen2 / Qwen2.5: biases on q/k/v only (random, not HF's zeros), GQA, RoPE base 1e6."""
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=tie, initializer_range=0.3,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.3)
    return model.eval()


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _compare(rank, world, cases, ids):
    errors = {}
    for tp in (1, 2):
        topo = Topology(world, rank, tp=tp).create_groups()
        for name, (hf_config, source, ref_logits) in cases.items():
            config = config_from_hf(hf_config, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                                    attention_dropout=0.0)
            model = GPTModel(config, topo).eval()
            assert load_hf(model, source) == []
            with torch.no_grad():
                logits = gather_from_tp_region(model(ids), topo.tp_group)[..., :VOCAB]
            errors[f"{name} tp{tp}"] = _max_rel(logits, ref_logits)
            back = to_hf_state_dict(model)
            hf_state = read_hf_folder(source)[1] if isinstance(source, str) else source
            for key, tensor in hf_state.items():
                if key in back:
                    errors[f"{name} tp{tp} roundtrip {key}"] = (back[key] - tensor).abs().max().item()
                else:
                    errors[f"{name} tp{tp} missing {key}"] = float("inf")
    return errors


def test_hf_logits_and_roundtrip(tmp_path):
    models = _hf_models()
    ids = torch.randint(0, VOCAB, (2, 12))
    cases = {}
    for name, model in models.items():
        with torch.no_grad():
            ref = model(ids).logits
        cases[f"{name} memory"] = (model.config, {k: v.clone() for k, v in model.state_dict().items()}, ref)
        folder = tmp_path / name
        model.save_pretrained(folder)
        assert (folder / "model.safetensors").exists()
        cases[f"{name} safetensors"] = (json.loads((folder / "config.json").read_text()), str(folder), ref)
        binfolder = tmp_path / f"{name}_bin"
        os.makedirs(binfolder)
        (binfolder / "config.json").write_text((folder / "config.json").read_text())
        torch.save(model.state_dict(), binfolder / "pytorch_model.bin")
        cases[f"{name} bin"] = (model.config.to_dict(), str(binfolder), ref)
    for errors in run_distributed(_compare, 2, cases, ids):
        bad = {k: v for k, v in errors.items() if v > (0.0 if "roundtrip" in k else 1e-5)}
        assert not bad, bad


def _qwen2_tokens(rank, world, cases, prompts):
    out = {}
    for tp in (1, 2):
        topo = Topology(world, rank, tp=tp).create_groups()
        for name, (hf_config, state) in cases.items():
            model = GPTModel(config_from_hf(hf_config, make_vocab_size_divisible_by=8), topo).eval()
            assert load_hf(model, state) == []
            out[f"{name} tp{tp}"] = generate(model, prompts, NEW).tokens
    return out



def test_qwen2_generates_as_transformers_at_tp_1_and_2():
    """Greedy continuations of Qwen2 (untied and tied) equal transformers' ``generate``."""
    prompts = [[5, 17, 3, 9, 41], [60, 61, 62, 63, 64, 65, 66, 70]]
    cases, expected = {}, {}
    for tie in (False, True):
        hf = qwen2(tie)
        name = "tied" if tie else "untied"
        cases[name] = (hf.config.to_dict(), {k: v.clone() for k, v in hf.state_dict().items()})
        expected[name] = []
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
            expected[name].append(out[0, len(prompt):].tolist())
        assert all(len(set(row)) > 2 for row in expected[name]), "degenerate reference"
    for got in run_distributed(_qwen2_tokens, 2, cases, prompts):
        assert got == {f"{n} tp{tp}": expected[n] for tp in (1, 2) for n in cases}, (got, expected)


def test_qwen2_config_export_and_refusals():
    """The config maps to --add-qkv-bias without other biases; its export rebuilds the HF model;
    a window on only some layers and exports that would drop or add biases are refused naming the key."""
    hf = qwen2(tie=True)
    config = config_from_hf(hf.config.to_dict())
    assert (config.add_qkv_bias, config.add_bias_linear, config.qkv_bias, config.tied_embeddings) == (
        True, False, True, True)
    assert config.to_args()["add_qkv_bias"] is True and arch_of_config(config) == "qwen2"
    exported = hf_config_of(config, "qwen2")
    assert exported["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in exported
    again = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**exported)).eval()
    again.load_state_dict(to_hf_state_dict(GPTModel(config, None).eval()))
    with pytest.raises(ValueError, match="Llama export needs: no QKV-only bias"):
        hf_config_of(config, "llama")
    from megazero.model.config import replace_config
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM export needs: a QKV bias \(--add-qkv-bias\)"):
        hf_config_of(replace_config(config, add_qkv_bias=False), "qwen2")
    with pytest.raises(ValueError, match=r"no biases but the QKV's"):
        hf_config_of(replace_config(config, add_bias_linear=True), "qwen2")
    cfg = dict(hf.config.to_dict(), use_sliding_window=True, sliding_window=6)  # max_window_layers 28: no layer
    assert config_from_hf(cfg).window_size is None
    assert config_from_hf(dict(cfg, max_window_layers=0, layer_types=None)).window_size == (5, 0)
    layer_types = dict(cfg, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="use_sliding_window=true with layer_types: layers mix full and sliding"):
        config_from_hf(layer_types)
