"""``convert_checkpoint.py from-hf`` / ``to-hf`` and ``megazero.load_model`` for DeepseekV3ForCausalLM:
a folder in DeepSeek's released layout (per-expert names, the correction bias, one MTP layer at
``model.layers.L``) imports, loads with transformers' logits, exports back to the same tensors
(exact) that transformers loads again, and ``tools/generate.py`` continues prompts as transformers'
greedy ``generate`` at TP 1 and EP 2; a ``save_pretrained`` folder (no MTP weights) imports without MTP."""
import json

import pytest
import torch

from megazero.checkpoint.convert.hf_moe import unfuse_experts
from megazero.inference.load_model import load_model
from megazero.testing import run_distributed
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_hf_deepseek import EOD, L, VOCAB, _mtp_state, hf_model
from tests.inference.test_generate import _run_tool

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
PROMPTS, NEW = ["5 17 3 9 41 2", "60 7 7 33 12 80"], 8


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    base = tmp_path_factory.mktemp("dsv3")
    hf = hf_model()
    folder = base / "hf"
    folder.mkdir()
    state = dict(unfuse_experts(hf.state_dict(), "deepseek_v3"), **_mtp_state(hf))
    safetensors.save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
                          metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(dict(hf.config.to_dict(), architectures=["DeepseekV3ForCausalLM"])))
    config, _ = tool().from_hf(str(folder), str(base / "mz"))
    return hf, state, str(base / "mz"), config


def test_import_load_export_exact(imported, tmp_path):
    hf, state, mz, config = imported
    flags = tool().pretrain_flags(config)
    for flag in ("--multi-latent-attention", "--mtp-num-layers 1", "--moe-router-score-function sigmoid",
                 "--moe-router-num-groups 4", "--moe-router-group-topk 2", "--moe-router-enable-expert-bias",
                 "--moe-layer-freq '[0,1,1]'", "--moe-router-topk-scaling-factor 2.5", "--q-lora-rank 16"):
        assert flag in flags, (flag, flags)
    ids = torch.randint(0, VOCAB - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = load_model(mz)(ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    tool().to_hf(mz, str(tmp_path / "out"))
    back = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    copies = {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"}
    assert set(back) == set(state) | copies and all(torch.equal(back[k], state[k]) for k in state)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_generate_tool_at_tp1_and_ep2(imported):
    hf, _, mz, _ = imported
    expected = []
    for prompt in PROMPTS:
        ids = [int(t) for t in prompt.split()]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=EOD,
                          pad_token_id=0)[0, len(ids):].tolist()
        expected.append(" " + " ".join(str(i) for i in (out[:out.index(EOD)] if EOD in out else out)))
    argv = ["--load", mz, "--max-new-tokens", str(NEW), "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB)] + [a for p in PROMPTS for a in ("--prompt", p)]
    for world, flags in ((1, []), (2, ["--expert-model-parallel-size", "2"])):
        got = run_distributed(_run_tool, world, argv + flags, timeout_s=120)
        assert all(g == expected for g in got), (flags, got[0], expected)


def test_save_pretrained_folder_imports_without_mtp(tmp_path, capsys):
    hf_model().save_pretrained(tmp_path / "hf")
    config, _ = tool().from_hf(str(tmp_path / "hf"), str(tmp_path / "mz"))
    assert config.mtp_num_layers is None and "imported without MTP" in capsys.readouterr().out
    assert load_model(str(tmp_path / "mz")).config.mtp_num_layers is None
