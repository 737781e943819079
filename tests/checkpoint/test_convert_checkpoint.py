"""tools/convert_checkpoint.py: consolidated fp32 equals the reader's masters; a Hugging Face
export loads in transformers with megazero's logits (GPT-2 and Llama styles); a Hugging Face
import loads into a TP 2 run and trains."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from megazero.checkpoint.reader import CheckpointReader
from tests.checkpoint.test_reshard import BASE, layout_flags, run

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"]


def tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def megazero_logits(reader, full, ids):
    from megazero.model import GPTConfig, GPTModel
    model = GPTModel(GPTConfig.from_saved_args(reader.args), None).eval()
    model.load_full_state_dict(full, strict=False)
    with torch.no_grad():
        return model(ids)[..., :reader.args["vocab_size"]]


@pytest.mark.parametrize("style,extra", [("gpt2", []), ("llama", LLAMA)])
def test_fp32_and_hf_export(tmp_path, style, extra):
    conv = tool()
    src = tmp_path / "ck"
    run(2, BASE + extra + ["--train-iters", "2", "--save", str(src)] + layout_flags(2, 1, None, 1))
    reader = CheckpointReader(str(src))
    full = conv.to_fp32(str(src), str(tmp_path / "fp32.pt"))
    loaded = torch.load(tmp_path / "fp32.pt", weights_only=True)
    assert list(loaded) == reader.param_names()
    for name in reader.param_names():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], reader.full_param(name, "master"))
    assert loaded["embedding.word_embeddings.weight"].shape[0] == 100  # real rows only (padded: 256)

    conv.to_hf(str(src), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if style == "gpt2" else "LlamaForCausalLM")
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = megazero_logits(reader, full, ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    out = hf.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)


def test_hf_import_then_train_in_tp2(tmp_path):
    conv = tool()
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path / "hf")
    config, tokenizer = conv.from_hf(str(tmp_path / "hf"), str(tmp_path / "mz"))
    assert tokenizer == {}  # the folder has no tokenizer files
    from megazero.checkpoint.convert.hf import hf_to_full
    expected = hf_to_full(hf.state_dict(), config, "llama")
    flags = BASE + conv.pretrain_flags(config).split() + ["--load", str(tmp_path / "mz")] + layout_flags(2, 1, None, 1)
    hist = run(2, flags, save_at_load=str(tmp_path / "tp2"))
    assert [i for i, _ in hist] == list(range(1, 7)) and all(np.isfinite(l) for _, l in hist)
    reader = CheckpointReader(str(tmp_path / "tp2"))
    assert reader.iteration == 0 and reader.layout["tensor_model_parallel_size"] == 2
    assert sorted(reader.param_names()) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(reader.full_param(name), t), name
        assert torch.equal(reader.full_param(name, "master"), t) and not reader.full_param(name, "exp_avg").any()
    # the imported model's first loss is its loss on that batch (same weights as transformers)
    assert hist[0][1] < 5.0
