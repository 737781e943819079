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

__all__ = ["HuggingFaceTokenizer", "TOKENIZER_FILES", "tokenizer_files_in", "import_tokenizer_files",
           "export_tokenizer_files"]

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


def import_tokenizer_files(hf_dir: str, root: str, subdir: str = "tokenizer") -> dict:
    """Copy ``hf_dir``'s tokenizer files into ``root/subdir``; returns the tokenizer flags to record
    (paths relative to ``root``), or ``{}`` when the folder has none.

    The type is what reads those files with the same ids as ``transformers``: ``tokenizer.json``
    -> ``HuggingFaceTokenizer``; else ``vocab.json`` + ``merges.txt`` -> ``GPT2BPETokenizer``;
    else ``tokenizer.model`` -> ``Llama2Tokenizer`` (bos first, as Llama's tokenizer).
    """
    import shutil

    names = tokenizer_files_in(hf_dir)
    if not names:
        return {}
    os.makedirs(os.path.join(root, subdir), exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(root, subdir, name))
    if "tokenizer.json" in names:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": subdir}
    if {"vocab.json", "merges.txt"} <= set(names):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(subdir, "vocab.json"),
                "merge_file": os.path.join(subdir, "merges.txt")}
    if "tokenizer.model" in names:
        return {"tokenizer_type": "Llama2Tokenizer", "tokenizer_model": os.path.join(subdir, "tokenizer.model")}
    return {}


def export_tokenizer_files(flags: dict, out_dir: str) -> list[str]:
    """Write the tokenizer named by ``flags`` (resolved paths) into an HF folder ``out_dir`` so that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it; returns the file names written.

    HuggingFaceTokenizer: its folder's tokenizer files, copied. GPT2BPETokenizer: vocab.json +
    merges.txt and a ``tokenizer_config.json`` naming ``GPT2Tokenizer`` with ``<|endoftext|>`` as
    bos/eos/unk. The sentencepiece types: ``tokenizer.model`` and a config naming
    ``LlamaTokenizer`` (``add_bos_token`` for Llama2Tokenizer only). NullTokenizer: nothing.
    """
    import shutil

    kind = flags.get("tokenizer_type")
    os.makedirs(out_dir, exist_ok=True)
    if kind == "HuggingFaceTokenizer":
        src = flags["tokenizer_model"]
        folder = src if os.path.isdir(src) else os.path.dirname(src)
        names = tokenizer_files_in(folder)
        for name in names:
            shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
        return names
    if kind == "GPT2BPETokenizer":
        shutil.copyfile(flags["vocab_file"], os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(flags["merge_file"], os.path.join(out_dir, "merges.txt"))
        eod = "<|endoftext|>"
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": eod, "eos_token": eod, "unk_token": eod,
                  "add_prefix_space": False}
    elif kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        shutil.copyfile(flags["tokenizer_model"], os.path.join(out_dir, "tokenizer.model"))
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": kind == "Llama2Tokenizer",
                  "add_eos_token": False}
        names = ["tokenizer.model"]
    else:
        return []
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    return (["vocab.json", "merges.txt"] if kind == "GPT2BPETokenizer" else names) + ["tokenizer_config.json"]
