"""``HuggingFaceTokenizer``: a Hugging Face tokenizer folder, read with the ``tokenizers`` package.

Megatron-LM's ``_HuggingFaceTokenizer`` (``megatron/training/tokenizer/tokenizer.py``, tag
``core_v0.13.0``) wraps ``transformers.AutoTokenizer``: ``tokenize(text)`` is
``tokenizer(text).input_ids`` (special tokens added by the post-processor, e.g. Llama's bos),
``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens), ``eod`` the eos token's id
and ``bos`` the bos token's id. Here the same files are read with ``tokenizers`` alone (an optional
extra, ``pip install 'megazero[hf]'``; ``transformers`` is not needed):

* ``--tokenizer-model`` is a folder or a ``tokenizer.json`` file. The folder's ``tokenizer.json``
  is used when present; otherwise ``vocab.json`` + ``merges.txt`` (a GPT-2 folder) give a
  byte-level BPE without prefix space, as ``transformers`` builds ``GPT2TokenizerFast`` from them.
* ``bos`` / ``eos``: ``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` (a string or a
  ``{"content": ...}`` object), else ``special_tokens_map.json``'s, else ``<|endoftext|>`` when
  the vocabulary has it (GPT-2). ``eod`` = the eos id.
* ``detokenize(ids)`` decodes with special tokens kept (``skip_special_tokens=False``).

``TOKENIZER_FILES`` are the files ``tools/convert_checkpoint.py`` copies with a model.
"""
from __future__ import annotations

import json
import os

__all__ = ["HuggingFaceTokenizer", "TOKENIZER_FILES", "tokenizer_files_in"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
MISSING_EXTRA = ("HuggingFaceTokenizer needs the 'tokenizers' package, an optional extra of megazero: "
                 "pip install 'megazero[hf]' (or pip install tokenizers)")


def tokenizer_files_in(folder: str) -> list[str]:
    """Names of the tokenizer files (``TOKENIZER_FILES``) present in ``folder``."""
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))]


def _token_text(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def _special_names(folder: str) -> dict:
    """``{"bos_token": str|None, "eos_token": str|None}`` from the folder's JSON configs."""
    names = {"bos_token": None, "eos_token": None}
    for config in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(folder, config)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            for key in names:
                if _token_text(data.get(key)):
                    names[key] = _token_text(data[key])
    return names


def _gpt2_files_tokenizer(tokenizers, vocab: str, merges: str):
    """A byte-level BPE like ``GPT2TokenizerFast`` of vocab.json + merges.txt (no prefix space)."""
    model = tokenizers.models.BPE.from_file(vocab, merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    return tok


class HuggingFaceTokenizer:
    """Megatron's ``HuggingFaceTokenizer`` on a local folder or ``tokenizer.json`` (module doc)."""

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(MISSING_EXTRA) from e
        self.path = path
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        file = path if os.path.isfile(path) else os.path.join(folder, "tokenizer.json")
        if os.path.isfile(file):
            self.tok = tokenizers.Tokenizer.from_file(file)
        elif all(os.path.isfile(os.path.join(folder, f)) for f in ("vocab.json", "merges.txt")):
            self.tok = _gpt2_files_tokenizer(tokenizers, os.path.join(folder, "vocab.json"),
                                             os.path.join(folder, "merges.txt"))
        else:
            raise FileNotFoundError(f"{path}: no tokenizer.json, nor vocab.json + merges.txt "
                                    "(HuggingFaceTokenizer reads a folder saved by transformers)")
        names = _special_names(folder)
        if names["eos_token"] is None and self.tok.token_to_id("<|endoftext|>") is not None:
            names = {"bos_token": names["bos_token"] or "<|endoftext|>", "eos_token": "<|endoftext|>"}
        self.bos = self._id_of(names["bos_token"])
        self.eos = self._id_of(names["eos_token"])

    def _id_of(self, token) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int | None:
        return self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])
