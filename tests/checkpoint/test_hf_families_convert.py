"""Qwen3 (sliding window, tied head), Qwen3-MoE and Mistral folders saved by ``transformers`` with
a tokenizer: ``convert_checkpoint.py from-hf`` records the tokenizer and prints the Megatron flags
(``--qk-layernorm``, ``--window-size W-1,0``), ``to-hf`` gives back the same tensors, config and
tokenizer (transformers reloads them with the same logits), ``megazero.load_model`` gives
transformers' logits, and ``tools/generate.py`` continues prompts as transformers' greedy
``generate`` at TP 1 and TP 2 (Qwen3-MoE: EP 2 too)."""
import json

import pytest
import torch

from megazero.data.hf_tokenizer import HuggingFaceTokenizer
from megazero.inference.load_model import load_model
from megazero.testing import run_distributed
from tests import hf_fixtures
from tests.checkpoint.test_convert_checkpoint import tool
from tests.data.conftest import kjv_texts
from tests.inference.test_generate import _run_tool

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,"]
NEW = 10
SMALL = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, max_position_embeddings=64, initializer_range=0.3, bos_token_id=0,
             eos_token_id=1, pad_token_id=None)
MODELS = {"qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
                    dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=0)),
          "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
          "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(sliding_window=5))}


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    """(style, HF folder, HF model, megazero checkpoint, GPTConfig, recorded tokenizer)."""
    base = tmp_path_factory.mktemp(request.param)
    hf_dir = str(base / "hf")
    hf_fixtures.llama_tokenizer(hf_dir, kjv_texts(60))
    make, cfg, extra = MODELS[request.param]
    torch.manual_seed(0)
    model = make(cfg(**SMALL, **extra)).eval()
    with torch.no_grad():  # norms and routers away from their initial values
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    config, tokenizer = tool().from_hf(hf_dir, str(base / "mz"))
    return request.param, hf_dir, model, str(base / "mz"), config, tokenizer


def test_import_flags_export_exact_and_tokenizer(imported, tmp_path):
    style, hf_dir, model, mz, config, tokenizer = imported
    conv = tool()
    flags = conv.pretrain_flags(config, tokenizer)
    assert ("--qk-layernorm" in flags) == style.startswith("qwen3") and "HuggingFaceTokenizer" in flags
    window = {"qwen3": "--window-size 3,0", "mistral": "--window-size 4,0"}.get(style)
    assert (window in flags) if window else "--window-size" not in flags
    conv.to_hf(mz, str(tmp_path / "out"))
    saved = safetensors.load_file(f"{hf_dir}/model.safetensors")
    back = safetensors.load_file(f"{tmp_path}/out/model.safetensors")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == [type(model).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(again(ids).logits, ref)
        ours = load_model(mz)(ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    texts = kjv_texts(5)
    tok_a, tok_b = (transformers.AutoTokenizer.from_pretrained(d) for d in (hf_dir, str(tmp_path / "out")))
    assert tok_a(texts).input_ids == tok_b(texts).input_ids


def test_generate_tool_matches_transformers(imported):
    style, hf_dir, model, mz, _, _ = imported
    tok = HuggingFaceTokenizer(hf_dir)
    expected = []
    for prompt in PROMPTS:
        ids = tok.tokenize(prompt)
        assert len(ids) > 5  # longer than the windows: the cache drops keys during generation
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eod,
                             pad_token_id=tok.eod)[0, len(ids):].tolist()
        new = out[:out.index(tok.eod)] if tok.eod in out else out
        assert len(set(new)) > 2, "degenerate reference"
        expected.append(tok.detokenize(ids + new)[len(tok.detokenize(ids)):])
    argv = ["--load", mz, "--max-new-tokens", str(NEW)] + [a for p in PROMPTS for a in ("--prompt", p)]
    layouts = [[], ["--tensor-model-parallel-size", "2"]]
    layouts += [["--expert-model-parallel-size", "2"]] if style == "qwen3_moe" else []
    for flags in layouts:
        world = 1 if not flags else 2
        got = run_distributed(_run_tool, world, argv + flags, timeout_s=120)
        assert all(g == expected for g in got), (style, flags, got[0], expected)
