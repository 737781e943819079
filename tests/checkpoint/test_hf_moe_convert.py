"""Mixtral and Qwen2-MoE (QKV biases: ``--add-qkv-bias``) folders saved by ``transformers``
(sharded) import with ``convert_checkpoint.py from-hf``, export back with ``to-hf`` to the same tensors (exact) under
the Hub's names, load in transformers with the same logits, and ``tools/generate.py`` continues
prompts as transformers' ``generate`` does with the experts over EP 2, TP 2 x EP 2 and
TP 2 x EP 2 x ETP 1."""
import json
import os

import pytest
import torch

from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.convert.hf import read_hf_folder
from megazero.testing import run_distributed
from tests.checkpoint.test_convert_checkpoint import megazero_logits, tool
from tests.checkpoint.test_hf_moe_mapping import EOD, VOCAB, mixtral, qwen2_moe
from tests.inference.test_generate import _run_tool

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
PROMPTS = ["5 17 3 9 41 2", "60 7 7 33 12 80"]
NEW = 8


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def imported(request, tmp_path_factory):
    """(style, HF folder, HF model, megazero checkpoint, GPTConfig)."""
    base = tmp_path_factory.mktemp(request.param)
    model = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}[request.param]()
    model.save_pretrained(base / "hf", max_shard_size="40KB")  # sharded, as real MoE models are
    config, _ = tool().from_hf(str(base / "hf"), str(base / "mz"))
    return request.param, str(base / "hf"), model, str(base / "mz"), config


def test_import_export_exact(imported, tmp_path):
    style, hf_dir, model, mz, config = imported
    conv = tool()
    flags = conv.pretrain_flags(config)
    assert "--num-experts 4 --moe-ffn-hidden-size 24" in flags and "--moe-router-topk 2" in flags
    assert ("--moe-shared-expert-gate" in flags) == ("--moe-router-pre-softmax" in flags) == (style == "qwen2_moe")
    assert ("--moe-layer-freq '[1,0,1]'" in flags) == (style == "qwen2_moe")
    assert ("--add-qkv-bias" in flags) == (style == "qwen2_moe") and "--disable-bias-linear" in flags
    reader = CheckpointReader(mz)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    ours = megazero_logits(reader, reader.full_model_state_dict(), ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    conv.to_hf(mz, str(tmp_path / "out"))
    saved = read_hf_folder(hf_dir)[1]
    assert len({s for s in os.listdir(hf_dir) if s.endswith(".safetensors")}) > 1  # from the shards
    back = safetensors.load_file(f"{tmp_path}/out/model.safetensors")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == [type(model).__name__] and cfg.get("qkv_bias", False) == (style == "qwen2_moe")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_generate_tool_at_ep(imported):
    style, _, model, mz, _ = imported
    expected = []
    for prompt in PROMPTS:
        ids = [int(t) for t in prompt.split()]
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=EOD,
                             pad_token_id=0)[0, len(ids):].tolist()
        new = out[:out.index(EOD)] if EOD in out else out
        expected.append(" " + " ".join(str(i) for i in new))
    argv = ["--load", mz, "--max-new-tokens", str(NEW), "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB)] + [a for p in PROMPTS for a in ("--prompt", p)]
    layouts = {"mixtral": [(2, ["--expert-model-parallel-size", "2"])],
               "qwen2_moe": [(4, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
                             (2, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                  "--expert-tensor-parallel-size", "1"])]}[style]
    for world, flags in layouts:
        got = run_distributed(_run_tool, world, argv + flags, timeout_s=120)
        assert all(g == expected for g in got), (style, flags, got[0], expected)
