"""Tokenizers chosen by ``--tokenizer-type``.

Every tokenizer exposes ``vocab_size`` (number of ids the model must embed, before padding),
``eod`` (the end-of-document id that ``--append-eod`` appends), ``tokenize(text) -> list[int]``
and ``detokenize(ids) -> str``.

* ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``
  (``--tokenizer-model m.model``): Megatron-LM's three sentencepiece flavours, see
  :mod:`megazero.data.sp_tokenizers` (special ids appended / plain ids / bos first).
* ``HuggingFaceTokenizer`` (``--tokenizer-model`` a folder or ``tokenizer.json``): see
  :mod:`megazero.data.hf_tokenizer` (needs the optional ``tokenizers`` package).
* ``GPT2BPETokenizer`` (``--vocab-file vocab.json --merge-file merges.txt``): GPT-2's byte-level
  BPE. Text -> UTF-8 bytes; the text is first split with GPT-2's regular expression
  (contractions ``'s 't 're 've 'm 'll 'd``, an optional space plus letters, plus digits, plus
  other symbols, then whitespace runs that leave their last space to the next word); each piece's
  bytes are mapped to printable unicode characters by GPT-2's reversible byte table, then merged
  by rank order (lowest rank first, all non-overlapping occurrences left to right) until no
  ranked pair is left; each resulting symbol is looked up in ``vocab.json``. This is exactly
  OpenAI's ``encoder.py`` algorithm, so the ids equal GPT-2's for any text (the literal string
  ``<|endoftext|>`` in text is *not* treated as special, as in Megatron). ``eod`` is
  ``<|endoftext|>``. Results per word are memoised in a per-instance bounded cache.
* ``NullTokenizer`` (``--vocab-size N``): text is whitespace-separated integer ids in ``[0, N)``;
  ``vocab_size = N`` and ``eod = N - 1`` (the last id). Megatron-LM's adds an extra id instead
  (eod = N, vocab N + 1); here ``--vocab-size`` is the model's vocabulary exactly, which is what
  ``arguments.py`` pads for NullTokenizer runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from megazero.data.hf_tokenizer import HuggingFaceTokenizer
from megazero.data.sp_tokenizers import (GPTSentencePieceTokenizer, Llama2Tokenizer,
                                         SentencePieceTokenizer)

__all__ = [
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer",
    "GPT2BPETokenizer", "NullTokenizer", "TokenizerConfig", "build_tokenizer", "TOKENIZER_TYPES", "TOKENIZER_FLAGS",
    "saved_tokenizer_flags", "bytes_to_unicode", "GPT2_PATTERN",
]

# --tokenizer-type values (Megatron-LM's names) -> the flag holding the file(s) each one reads.
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")
# the tokenizer's flags, as argparse dests (what a checkpoint records and generate.py reads back)
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")

# GPT-2's pre-tokenization pattern (OpenAI encoder.py), for the `regex` package (\p classes).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ': 188 of them) map
    to themselves; the other 68 bytes, in increasing order, map to chr(256), chr(257), ...
    So a space (0x20) becomes 'Ġ' (chr(288)) and a newline (0x0A) becomes 'Ċ' (chr(266)).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in kept:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def merge_pair(symbols: list[str], first: str, second: str) -> list[str]:
    """Replace every adjacent ``(first, second)`` in ``symbols`` by ``first + second``, left to right."""
    merged, i, n = [], 0, len(symbols)
    while i < n:
        if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
            merged.append(first + second)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


class GPT2BPETokenizer:
    """Byte-level BPE with GPT-2's vocab.json / merges.txt (see the module docstring)."""

    def __init__(self, vocab_file: str, merge_file: str, cache_size: int = 1 << 17):
        import regex

        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: s for s, i in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = [tuple(line.split()) for line in lines if line.strip()]
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise ValueError(f"{merge_file}: malformed merge line {' '.join(bad[0])!r}")
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # One str per byte value: faster than a dict lookup per byte in the hot loop.
        self._byte_chars = [self.byte_encoder[b] for b in range(256)]
        self.pattern = regex.compile(GPT2_PATTERN)
        self._cache: dict[str, list[int]] = {}
        self._cache_size = cache_size
        if GPT2_EOD not in self.encoder:
            raise ValueError(f"{vocab_file}: no {GPT2_EOD!r} token (needed as eod)")
        self._eod = self.encoder[GPT2_EOD]

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod

    def bpe(self, word: str) -> list[str]:
        """Merge the characters of one byte-mapped word by rank; returns its symbols."""
        symbols = list(word)
        ranks = self.bpe_ranks
        while len(symbols) > 1:
            best, best_rank = None, None
            for pair in zip(symbols, symbols[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            symbols = merge_pair(symbols, *best)
        return symbols

    def _word_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            chars = self._byte_chars
            word = "".join(chars[b] for b in piece.encode("utf-8"))
            try:
                ids = [self.encoder[s] for s in self.bpe(word)]
            except KeyError as e:
                raise KeyError(f"BPE symbol {e.args[0]!r} is not in vocab.json") from None
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.pattern.findall(text):
            out.extend(self._word_ids(piece))
        return out

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


class NullTokenizer:
    """Whitespace-separated integer ids in [0, N); ``vocab_size = N``, ``eod = N - 1``."""

    def __init__(self, vocab_size: int):
        self._n = int(vocab_size)
        if self._n <= 1:
            raise ValueError("NullTokenizer needs --vocab-size > 1")

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self._n - 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        for i in ids:
            if not 0 <= i < self._n:
                raise ValueError(f"NullTokenizer: id {i} outside [0, {self._n})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer, from which files (Megatron's flags; :data:`TOKENIZER_FLAGS` by dest name)."""

    type: str | None = None
    """``--tokenizer-type``: one of :data:`TOKENIZER_TYPES` (None: none named)."""
    model: str | None = None
    """``--tokenizer-model``: a sentencepiece ``.model``, or HuggingFaceTokenizer's folder / ``tokenizer.json``."""
    vocab_file: str | None = None
    """``--vocab-file`` (GPT2BPETokenizer)."""
    merge_file: str | None = None
    """``--merge-file`` (GPT2BPETokenizer)."""
    vocab_size: int | None = None
    """``--vocab-size`` (NullTokenizer)."""

    @classmethod
    def from_flags(cls, flags: dict) -> "TokenizerConfig":
        """From Megatron-named values (``tokenizer_type``, ``tokenizer_model``, ...; absent = unset),
        e.g. what a checkpoint recorded."""
        return cls(type=flags.get("tokenizer_type"), model=flags.get("tokenizer_model"),
                   vocab_file=flags.get("vocab_file"), merge_file=flags.get("merge_file"),
                   vocab_size=flags.get("vocab_size"))


def build_tokenizer(config: TokenizerConfig):
    """Build the tokenizer ``config`` names: the sentencepiece types and HuggingFaceTokenizer
    read ``model``, GPT2BPETokenizer ``vocab_file`` and ``merge_file``, NullTokenizer
    ``vocab_size``. A missing one is named by its flag."""
    kind = config.type

    def need(value, flag):
        if value is None:
            raise ValueError(f"--tokenizer-type {kind} needs {flag}")
        return value

    sentencepiece = {"SentencePieceTokenizer": SentencePieceTokenizer, "Llama2Tokenizer": Llama2Tokenizer,
                     "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                     "HuggingFaceTokenizer": HuggingFaceTokenizer}
    if kind in sentencepiece:
        return sentencepiece[kind](need(config.model, "--tokenizer-model"))
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(need(config.vocab_file, "--vocab-file"), need(config.merge_file, "--merge-file"))
    if kind == "NullTokenizer":
        return NullTokenizer(need(config.vocab_size, "--vocab-size"))
    if kind is None:
        raise ValueError(f"--tokenizer-type is required: one of {', '.join(TOKENIZER_TYPES)}")
    raise ValueError(f"unknown --tokenizer-type {kind!r}; expected one of {', '.join(TOKENIZER_TYPES)}")


def saved_tokenizer_flags(saved_args: dict, checkpoint_dir: str) -> dict:
    """The tokenizer flags a checkpoint recorded (``TOKENIZER_FLAGS`` found in its saved args).

    A relative path that exists under ``checkpoint_dir`` comes back joined to it (``from-hf``
    records ``tokenizer``, the folder it copies the files into, so the checkpoint can move);
    other paths come back as recorded. Empty when no ``tokenizer_type`` was recorded.
    """
    import os

    if not saved_args.get("tokenizer_type"):
        return {}
    flags = {"tokenizer_type": saved_args["tokenizer_type"]}
    for key in TOKENIZER_FLAGS[1:]:
        value = saved_args.get(key)
        if value is not None:
            inside = os.path.join(checkpoint_dir, value)
            flags[key] = inside if not os.path.isabs(value) and os.path.exists(inside) else value
    return flags
