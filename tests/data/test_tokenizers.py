"""Tokenizers: GPT-2 byte-level BPE exactness, sentencepiece eod, NullTokenizer, factory
(Megatron's other types: test_megatron_tokenizers.py)."""
import json
import random

import pytest
import regex

from megazero.data.tokenizers import (GPT2_PATTERN, GPT2BPETokenizer, NullTokenizer,
                                      SentencePieceTokenizer, TokenizerConfig, build_tokenizer,
                                      bytes_to_unicode)


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"
    assert table[ord("A")] == "A" and table[0xA9] == "©" and table[0xAD] == "Ń"


@pytest.mark.parametrize("text, pieces", [
    ("he'll don't", ["he", "'ll", " don", "'t"]),
    ("Hello  world", ["Hello", " ", " world"]),
    ("x 123abc", ["x", " 123", "abc"]),
    ("é😀!!", ["é", "😀!!"]),
    ("a\n\nb", ["a", "\n", "\n", "b"]),
    ("it's   ", ["it", "'s", "   "]),
])
def test_gpt2_pretokenization(text, pieces):
    assert regex.findall(GPT2_PATTERN, text) == pieces


@pytest.fixture
def handmade(tmp_path):
    """256 byte symbols with id == byte value, 8 merges, then <|endoftext|> (id 264)."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("'", "s"), ("l", "l"), ("'", "ll"),
              ("Ã", "©"), ("Ġ", "Ġ")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" +
                                         "".join(f"{a} {b}\n" for a, b in merges))
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


# Expected ids worked out by hand from the merges above (bytes map to their own value).
HANDMADE_CASES = [
    (" the", [258]),                                  # Ġ t -> Ġt; h e -> he; Ġt he -> Ġthe
    ("it's", [105, 116, 259]),                        # it | 's
    ("he'll", [257, 261]),                            # he | ' l l -> ' ll -> 'll
    ("café", [99, 97, 102, 262]),                     # é = C3 A9 -> Ã© merged
    ("a   b", [97, 263, 32, 98]),                     # a | two spaces | " b"
    ("😀", [0xF0, 0x9F, 0x98, 0x80]),                 # raw UTF-8 bytes
    ("x\n\n", [120, 10, 10]),
    ("  hello", [32, 32, 257, 260, 111]),             # " " | Ġ he ll o
]


@pytest.mark.parametrize("text, ids", HANDMADE_CASES)
def test_gpt2_handmade_expected_ids(handmade, text, ids):
    tok = GPT2BPETokenizer(*handmade)
    assert tok.tokenize(text) == ids
    assert tok.detokenize(ids) == text
    assert tok.eod == 264 and tok.vocab_size == 265


def test_gpt2_handmade_matches_transformers(handmade):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Tokenizer(*handmade)
    tok = GPT2BPETokenizer(*handmade)
    for text, ids in HANDMADE_CASES:
        assert hf.encode(text) == ids == tok.tokenize(text)


def _random_texts(n, seed=0):
    rng = random.Random(seed)
    alphabet = (list("abcdefghij ABCXYZ  '\n\t.,!?0123456789") + list("éüñßçΩπжшअ中文😀👍🏽‍ ")
                + ["'s", "'ll", "'re", " 's", "  ", "\u00a0"])
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def test_gpt2_trained_vocab_matches_transformers(gpt2_files, tricky):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Tokenizer(*gpt2_files)
    tok = GPT2BPETokenizer(*gpt2_files)
    for text in tricky + _random_texts(300):
        assert tok.tokenize(text) == hf.encode(text), repr(text)


def test_gpt2_roundtrip_and_cache(gpt2_files, tricky):
    tok = GPT2BPETokenizer(*gpt2_files, cache_size=8)
    for text in tricky + _random_texts(200, seed=1):
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert tok.tokenize(text) == ids  # served partly from the (bounded) cache
    assert len(tok._cache) <= 8
    assert tok.eod == tok.vocab_size - 1


def test_sentencepiece_is_megatrons(sp_model):
    """Megatron's SentencePieceTokenizer: <CLS> <SEP> <EOD> <MASK> <PAD> appended after the 600
    pieces; <s> and the eos piece (named <eod> by train_tokenizer.py) keep their ids."""
    tok = SentencePieceTokenizer(sp_model)
    assert tok.vocab_size == 605 and tok.eod == 602 and tok.sp.id_to_piece(2) == "<eod>"
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.bos, tok.eos) == (600, 601, 603, 604, 1, 2)
    text = "In the beginning God created the heaven and the earth."
    assert tok.tokenize(text) == tok.sp.encode(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch([text, "x<EOD>"]) == [tok.tokenize(text), tok.tokenize("x<EOD>")]
def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 100 and tok.eod == 99
    assert tok.tokenize("1 2  3\n42") == [1, 2, 3, 42]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")


def test_build_tokenizer(sp_model, gpt2_files):
    def ns(**flags):  # Megatron's flag names
        return TokenizerConfig.from_flags(flags)
    assert isinstance(build_tokenizer(ns(tokenizer_type="SentencePieceTokenizer",
                                         tokenizer_model=sp_model)), SentencePieceTokenizer)
    assert isinstance(build_tokenizer(ns(tokenizer_type="GPT2BPETokenizer",
                                         vocab_file=gpt2_files[0], merge_file=gpt2_files[1])),
                      GPT2BPETokenizer)
    assert build_tokenizer(ns(tokenizer_type="NullTokenizer", vocab_size=7)).vocab_size == 7
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer(ns(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0],
                           merge_file=None))
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        assert type(build_tokenizer(ns(tokenizer_type=kind, tokenizer_model=sp_model))).__name__ == kind
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        build_tokenizer(ns(tokenizer_type="BertWordPiece"))
