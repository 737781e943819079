"""Megatron-LM's tokenizer types (tokenizer.py of tag core_v0.13.0): SentencePieceTokenizer's
special ids, GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer (ids equal
``transformers.AutoTokenizer``'s on the bundled corpus), and preprocess_data.py with each."""
import sys

import numpy as np
import pytest

from megazero.data import IndexedDataset
from megazero.data.tokenizers import (GPTSentencePieceTokenizer, HuggingFaceTokenizer, Llama2Tokenizer,
                                      SentencePieceTokenizer, TokenizerConfig, build_tokenizer)
from tests import hf_fixtures
from tests.data.conftest import TRICKY, kjv_texts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus():
    return kjv_texts() + TRICKY


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory):
    return hf_fixtures.llama_tokenizer(str(tmp_path_factory.mktemp("hf_llama")), kjv_texts(100) + TRICKY)


def test_sentencepiece_special_tokens_split_text(sp_model):
    """Special strings in text become their ids (earliest first); ordinary runs go to sentencepiece;
    detokenize writes each special token followed by a space, as Megatron's does."""
    tok = SentencePieceTokenizer(sp_model)
    sp = tok.sp
    ids = tok.tokenize("light<EOD>dark <s>x<MASK><MASK>")
    assert ids == sp.encode("light") + [602] + sp.encode("dark ") + [1] + sp.encode("x") + [603, 603]
    assert tok.tokenize("<eod>") == [2]  # the eos piece is a special token there
    assert tok.detokenize(sp.encode("light") + [602] + sp.encode("dark")) == "light <EOD> dark"
    extra = SentencePieceTokenizer(sp_model, vocab_extra_ids=3)
    assert extra.vocab_size == 608 and extra.tokenize("<extra_id_2>") == [607]


def test_sentencepiece_flavours_equal_sentencepiece_on_corpus(sp_model, corpus):
    """GPTSentencePiece = sentencepiece's ids; Llama2 = [bos] + them; SentencePieceTokenizer equals
    them on text without special strings (the bundled corpus)."""
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_file=sp_model).encode(corpus)
    gpt, llama, meg = (cls(sp_model) for cls in (GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer))
    assert gpt.tokenize_batch(corpus) == ref and (gpt.vocab_size, gpt.eod) == (600, 2)
    assert llama.tokenize_batch(corpus) == [[1] + r for r in ref] and (llama.vocab_size, llama.eod) == (600, 2)
    assert llama.tokenize(corpus[0]) == [1] + ref[0]
    assert meg.tokenize_batch(corpus) == ref
    assert gpt.detokenize(ref[3]) == corpus[3] and llama.detokenize(llama.tokenize(corpus[3])) == corpus[3]


def test_huggingface_tokenizer_equals_autotokenizer(hf_llama_dir, corpus):
    ref = transformers.AutoTokenizer.from_pretrained(hf_llama_dir)
    tok = build_tokenizer(TokenizerConfig(type="HuggingFaceTokenizer", model=hf_llama_dir))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.tokenize_batch(corpus) == ref(corpus).input_ids
    assert (tok.vocab_size, tok.eod, tok.bos) == (len(ref), ref.eos_token_id, ref.bos_token_id) == (500, 1, 0)
    assert tok.tokenize(corpus[5])[0] == 0  # the post-processor's bos
    assert tok.detokenize(tok.tokenize(corpus[5])[1:]) == corpus[5]
    assert HuggingFaceTokenizer(hf_llama_dir + "/tokenizer.json").tokenize(corpus[1]) == tok.tokenize(corpus[1])


def test_huggingface_gpt2_folder(tmp_path, gpt2_files, corpus):
    """A GPT-2 folder saved by transformers, and bare vocab.json + merges.txt, equal GPT2BPETokenizer."""
    import shutil

    from megazero.data.tokenizers import GPT2BPETokenizer
    texts = corpus[:200] + TRICKY
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in gpt2_files:
        shutil.copy(f, bare)
    saved = str(tmp_path / "saved")
    transformers.GPT2Tokenizer(*gpt2_files).save_pretrained(saved)
    ref = transformers.AutoTokenizer.from_pretrained(saved)
    ours = GPT2BPETokenizer(*gpt2_files)
    want = [ours.tokenize(t) for t in texts]
    for folder in (str(bare), saved):
        tok = HuggingFaceTokenizer(folder)
        assert tok.tokenize_batch(texts) == want == ref(texts).input_ids
        assert (tok.vocab_size, tok.eod) == (ours.vocab_size, ours.eod) == (len(ref), ref.eos_token_id)


def test_huggingface_tokenizer_names_the_extra(monkeypatch, hf_llama_dir):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(ImportError, match=r"megazero\[hf\]"):
        HuggingFaceTokenizer(hf_llama_dir)


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer",
                                  "HuggingFaceTokenizer"])
def test_preprocess_with_each_type(tmp_path, tool, small_corpus, sp_model, hf_llama_dir, kind):
    model = hf_llama_dir if kind == "HuggingFaceTokenizer" else sp_model
    prefix = str(tmp_path / "out")
    r = tool("preprocess_data.py", "--input", small_corpus[0], "--output-prefix", prefix, "--tokenizer-type",
             kind, "--tokenizer-model", model, "--append-eod", "--workers", "2")
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer(TokenizerConfig(type=kind, model=model))
    ds = IndexedDataset(prefix + "_text_document")
    docs = [d for d in small_corpus[1] if tok.tokenize(d)]
    assert len(ds) == len(docs)
    for i in (0, 7, len(docs) - 1):
        assert np.array_equal(ds[i], tok.tokenize(docs[i]) + [tok.eod])
