"""A model and tokenizer saved by ``transformers`` (Llama: GQA, untied head, Llama-style
tokenizer.json; Qwen2.5-style: Llama's with biases on q/k/v only (``--add-qkv-bias``), tied head;
GPT-2: tanh GELU, tied head, vocab.json + merges.txt) imports with from-hf,
exports back with logits within 1e-5, generates at TP 1/2/4 the tokens transformers' own
``generate`` gives, trains in TP 2 x PP 2 x DP 2 with no tokenizer flag, exports, and loads back
in transformers (model and AutoTokenizer)."""
import os

import numpy as np
import pytest
import torch

from megazero.checkpoint.reader import CheckpointReader
from megazero.testing import run_distributed
from tests import hf_fixtures
from tests.checkpoint.test_convert_checkpoint import megazero_logits, tool
from tests.checkpoint.test_reshard import run
from tests.data.conftest import kjv_texts
from tests.inference.test_generate import _run_tool
from tests.test_training import TINY, layout_flags

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
PROMPTS = ["In the beginning God", "And the LORD said unto Moses,"]
NEW = 10


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def imported(request, tmp_path_factory):
    """(style, HF folder, original HF model, megazero checkpoint, config, recorded tokenizer)."""
    style, base = request.param, tmp_path_factory.mktemp(request.param)
    hf_dir, texts = str(base / "hf"), kjv_texts(60)
    if style in ("llama", "qwen2"):
        hf_fixtures.llama_tokenizer(hf_dir, texts)
        model = getattr(hf_fixtures, f"{style}_model")(hf_dir, vocab_size=500)
    else:
        hf_fixtures.gpt2_tokenizer(hf_dir, texts)
        model = hf_fixtures.gpt2_model(hf_dir, vocab_size=len(transformers.AutoTokenizer.from_pretrained(hf_dir)))
    config, tokenizer = tool().from_hf(hf_dir, str(base / "mz"))
    return style, hf_dir, model, str(base / "mz"), config, tokenizer


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_import_records_tokenizer_and_flags(imported):
    style, hf_dir, _, mz, config, tokenizer = imported
    conv = tool()
    assert tokenizer["tokenizer_type"] == "HuggingFaceTokenizer"  # transformers saved a tokenizer.json
    assert os.path.isfile(os.path.join(mz, "tokenizer", "tokenizer.json"))
    assert CheckpointReader(mz).args["tokenizer_type"] == "HuggingFaceTokenizer"
    flags = conv.pretrain_flags(config, tokenizer)
    assert ("--openai-gelu" in flags) == (style == "gpt2") and ("--swiglu" in flags) == (style != "gpt2")
    assert ("--add-qkv-bias" in flags) == (style == "qwen2") and ("--disable-bias-linear" in flags) == (style != "gpt2")
    assert ("--untie-embeddings-and-output-weights" in flags) == (style == "llama")


def test_roundtrip_logits_and_tokenizer(imported, tmp_path):
    style, hf_dir, model, mz, _, _ = imported
    tool().to_hf(mz, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    diff = (hf_logits(back, ids) - hf_logits(model, ids)).abs().max().item()
    assert diff <= 1e-5, f"{style}: round-trip logits differ by {diff}"
    reader = CheckpointReader(mz)  # and megazero's own forward (GPT-2: --openai-gelu's tanh GELU)
    ours = megazero_logits(reader, reader.full_model_state_dict(), ids)
    assert (ours - hf_logits(model, ids)).abs().max().item() <= 1e-5
    ref, again = (transformers.AutoTokenizer.from_pretrained(d) for d in (hf_dir, str(tmp_path / "out")))
    texts = kjv_texts(5)
    assert again(texts).input_ids == ref(texts).input_ids and again.eos_token_id == ref.eos_token_id


def test_generate_matches_transformers_at_tp_1_2_4(imported):
    style, hf_dir, model, mz, _, _ = imported
    from megazero.data.hf_tokenizer import HuggingFaceTokenizer
    ours = HuggingFaceTokenizer(hf_dir)
    expected = []
    for prompt in PROMPTS:
        ids = ours.tokenize(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=ours.eod,
                             pad_token_id=ours.eod)[0, len(ids):].tolist()
        new = out[:out.index(ours.eod)] if ours.eod in out else out
        assert len(set(new)) > 2, "degenerate reference"
        full, head = ours.detokenize(ids + new), ours.detokenize(ids)
        expected.append(full[len(head):])
    argv = ["--load", mz, "--max-new-tokens", str(NEW)] + [a for p in PROMPTS for a in ("--prompt", p)]
    for tp in (1, 2, 4):
        got = run_distributed(_run_tool, tp, argv + ["--tensor-model-parallel-size", str(tp)], timeout_s=120)
        assert all(g == expected for g in got), (style, tp, got[0], expected)


def test_trains_in_3d_then_exports(imported, tmp_path):
    style, hf_dir, _, mz, config, tokenizer = imported
    conv = tool()
    save = str(tmp_path / "trained")
    flags = (TINY + ["--mock-data", "--train-iters", "2", "--load", mz, "--save", save, "--seq-length", "32"]
             + conv.pretrain_flags(config).split() + layout_flags(2, 2, None, 1))
    hist = run(8, flags)  # TP 2 x PP 2 x DP 2, no tokenizer flag
    assert [i for i, _ in hist] == [1, 2] and all(np.isfinite(l) for _, l in hist)
    reader = CheckpointReader(save)
    assert reader.args["tokenizer_type"] == "HuggingFaceTokenizer"
    assert reader.args["tokenizer_model"] == os.path.join(mz, "tokenizer")
    conv.to_hf(save, str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf_logits(hf, ids), megazero_logits(reader, reader.full_model_state_dict(), ids),
                               rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok(PROMPTS[0]).input_ids == transformers.AutoTokenizer.from_pretrained(hf_dir)(PROMPTS[0]).input_ids


def test_load_model_gives_transformers_logits(imported):
    """``megazero.load_model`` of the import: one process, logits over the real vocabulary."""
    import megazero
    style, _, model, mz, _, _ = imported
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ours = megazero.load_model(mz)
    with torch.no_grad():
        logits = ours(ids)
    assert logits.shape == (2, 16, model.config.vocab_size)
    assert (logits - hf_logits(model, ids)).abs().max().item() <= 1e-5, style


def test_an_import_loaded_without_its_flags_is_refused_and_use_checkpoint_args_takes_them(imported):
    """Issue 30's example: GPT-2 without --openai-gelu would train exact GELU (Qwen2 without
    --add-qkv-bias would drop its QKV bias); it is refused, naming the flag; --use-checkpoint-args
    with no model flag at all builds the imported model."""
    from megazero.arguments import parse_args
    from megazero.checkpoint import CheckpointError
    from megazero.training.build import build_configs
    from tests.faults.common import TINY
    style, _, _, mz, config, _ = imported
    run = TINY[8:] + ["--seq-length", "16", "--mock-data", "--train-iters", "2", "--load", mz]
    dropped = {"gpt2": "--openai-gelu", "qwen2": "--add-qkv-bias"}.get(style, "--swiglu")
    flags = [f for f in tool().pretrain_flags(config).split() if f != dropped]
    with pytest.raises(CheckpointError) as e:
        build_configs(parse_args(flags + run, world_size=1, training=True))
    assert str(e.value) == (f"--load {mz} holds another model than the command line describes: {dropped}: command "
                            "line False, checkpoint True (give the checkpoint's values, or --use-checkpoint-args "
                            "to take them from it)")
    vocab = ["--vocab-size", str(config.vocab_size)]  # the data's, not a model flag (Megatron copies none)
    built = build_configs(parse_args(run + vocab + ["--use-checkpoint-args"], world_size=1, training=True)).model
    assert built.activation == config.activation and built.num_layers == config.num_layers
    assert built.qkv_bias == config.qkv_bias and built.add_bias_linear == config.add_bias_linear
