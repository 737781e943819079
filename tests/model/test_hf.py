"""Megazero models loaded from random-initialized HF GPT-2 / Llama give transformers' logits.

fp32, max |a - b| / max |b| <= 1e-5, at TP = 1 and TP = 2; weights load from memory, from a saved
folder (safetensors and pytorch_model.bin) and convert back unchanged. Skips without transformers.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megazero.model import GPTModel  # noqa: E402
from megazero.checkpoint.convert.hf import config_from_hf, load_hf, read_hf_folder, to_hf_state_dict  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402
from megazero.parallel.topology import Topology  # noqa: E402

VOCAB = 100


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
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        with torch.no_grad():  # make biases and norms non-trivial too
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.eval()
        models[name] = model
    return models


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
