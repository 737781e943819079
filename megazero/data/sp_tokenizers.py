"""Megatron-LM's three sentencepiece tokenizers, by the same names and with the same ids.

Semantics follow ``megatron/training/tokenizer/tokenizer.py`` of NVIDIA/Megatron-LM (tag
``core_v0.13.0``: ``_SentencePieceTokenizer``, ``_GPTSentencePieceTokenizer``,
``_Llama2Tokenizer``), so a dataset tokenized by Megatron-LM with a given ``--tokenizer-type``
has the same ids, eod and vocabulary size here.

* ``SentencePieceTokenizer``: the model's P pieces, then special tokens appended in this order
  when the vocabulary lacks them: ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, the pad piece
  (``<PAD>`` when the model has no pad id), the bos piece (``<BOS>`` if none), the eos piece
  (``<EOS>`` if none), then ``<extra_id_0>`` ... for ``vocab_extra_ids``. A special token already
  among the pieces keeps its id. ``vocab_size`` = P + (number appended); ``eod`` = id of
  ``<EOD>`` (P + 2 for a model with no such piece). ``tokenize`` scans the text for the special
  tokens' literal strings: text before the earliest one (ties: the one added first) is encoded
  by sentencepiece, the special token becomes its id, and the scan continues after it.
  ``detokenize`` decodes runs of ordinary ids and writes each special token's string, each
  followed by a space (the run before it too).
* ``GPTSentencePieceTokenizer``: plain sentencepiece ids (no added tokens, no bos);
  ``vocab_size`` = P, ``eod`` = the model's eos id.
* ``Llama2Tokenizer``: ``[bos] + sentencepiece ids``; ``vocab_size`` = P, ``eod`` = eos id.
"""
from __future__ import annotations

__all__ = ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"]


class GPTSentencePieceTokenizer:
    """Megatron's ``GPTSentencePieceTokenizer``: sentencepiece ids as they are, ``eod = eos_id``."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.model_file = model_file
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.bos, self.eos, self.pad = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"model_file": self.model_file}

    def __setstate__(self, state):
        self.__init__(state["model_file"])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: ``[bos] + ids`` (text completion: no eos), ``eod = eos_id``."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos < 0:
            raise ValueError(f"{model_file}: Llama2Tokenizer needs a bos piece")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + self.sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos] + ids for ids in self.sp.encode(texts, out_type=int, num_threads=1)]


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``SentencePieceTokenizer``: pieces plus appended special tokens (module doc)."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file)
        self.vocab_extra_ids = int(vocab_extra_ids)
        sp = self.sp
        self.vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self.special: dict[str, int] = {}  # insertion order = Megatron's order (breaks ties)

        def piece_or(idx: int, default: str) -> str:
            return sp.id_to_piece(idx) if 0 <= idx < sp.get_piece_size() else default

        names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>", piece_or(sp.pad_id(), "<PAD>"),
                 piece_or(sp.bos_id(), "<BOS>"), piece_or(sp.eos_id(), "<EOS>")]
        names += [f"<extra_id_{i}>" for i in range(self.vocab_extra_ids)]
        for name in names:
            self.vocab.setdefault(name, len(self.vocab))
            self.special[name] = self.vocab[name]
        self.inv_special = {i: t for t, i in self.special.items()}
        self.cls, self.sep, self.mask = (self.vocab[t] for t in ("<CLS>", "<SEP>", "<MASK>"))
        self.pad, self.bos, self.eos = (self.special[t] for t in names[4:7])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        return self.vocab["<EOD>"]

    def _next_special(self, text: str, start: int):
        """(position, token) of the earliest special token at or after ``start``, or None."""
        best = None
        for token in self.special:
            pos = text.find(token, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, token)
        return best

    def tokenize(self, text: str) -> list[int]:
        ids, start = [], 0
        while (hit := self._next_special(text, start)) is not None:
            pos, token = hit
            ids.extend(self.sp.encode(text[start:pos], out_type=int))
            ids.append(self.special[token])
            start = pos + len(token)
        ids.extend(self.sp.encode(text[start:], out_type=int))
        return ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """``tokenize`` of each text; texts without special strings are encoded in one call."""
        plain = [i for i, t in enumerate(texts) if not any(s in t for s in self.special)]
        out: list[list[int] | None] = [None] * len(texts)
        for i, ids in zip(plain, self.sp.encode([texts[i] for i in plain], out_type=int, num_threads=1)):
            out[i] = ids
        return [ids if ids is not None else self.tokenize(t) for ids, t in zip(out, texts)]

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, idx in enumerate(ids):
            if idx in self.inv_special:
                text += self.sp.decode(ids[last:i]) + " " + self.inv_special[idx] + " "
                last = i + 1
        return text + self.sp.decode(ids[last:])

    def __getstate__(self):
        return {"model_file": self.model_file, "vocab_extra_ids": self.vocab_extra_ids}

    def __setstate__(self, state):
        self.__init__(state["model_file"], state.get("vocab_extra_ids", 0))
