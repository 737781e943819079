#!/usr/bin/env python
"""Train a sentencepiece tokenizer on a JSONL corpus.

    python tools/train_tokenizer.py --input data/kjv.jsonl.gz --json-keys text \\
        --vocab-size 4096 --output-prefix data/prepared/kjv_sp

Writes ``{output-prefix}.model`` and ``{output-prefix}.vocab`` (renamed into place only when
training succeeded). Ids 0, 1, 2 are ``<unk>``, ``<s>`` and ``<eod>`` (sentencepiece's
end-of-sentence piece, renamed), so ``GPTSentencePieceTokenizer.eod == 2`` (Megatron's
``SentencePieceTokenizer`` appends its own ``<EOD>``, id 4098 for 4096 pieces); no pad piece.
``--byte-fallback`` (on by default) adds 256 byte pieces so any UTF-8 text round-trips without
``<unk>``.

Documents are cut into sentences (at ``. ! ? ; :`` followed by space, and at newlines) for
training, and at most ``--input-sentence-size`` of them (default 300k, sampled) are used, which
keeps training on a few MB of text to a few seconds.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megazero.checkpoint.guard import checkpoint_holding  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, optionally .gz")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model, PREFIX.vocab")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe", "char", "word"])
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--input-sentence-size", type=int, default=300_000)
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false")
    p.add_argument("--seed", type=int, default=1234, help="sentence sampling seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")


def iter_sentences(path: str, keys: list[str]):
    """Yield training sentences from every key of every JSON line."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                texts = [obj[k] for k in keys]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"error: {path}:{lineno}: bad line ({e!r})") from None
            for text in texts:
                for sentence in _SENTENCE_END.split(text):
                    if sentence.strip():
                        yield sentence.strip()


def train(args) -> str:
    import sentencepiece as spm

    spm.set_random_generator_seed(args.seed)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".train_tokenizer-") as tmp:
        tmp_prefix = os.path.join(tmp, "m")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter_sentences(args.input, args.json_keys),
            model_prefix=tmp_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=200_000,
            max_sentence_length=1 << 14,
            byte_fallback=args.byte_fallback,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, eos_piece="<eod>",
            num_threads=args.threads,
            minloglevel=2,
        )
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, args.output_prefix + ext)
    return args.output_prefix + ".model"


def main(argv=None) -> int:
    args = get_args(argv)
    if not os.path.isfile(args.input):
        print(f"error: {args.input}: no such file", file=sys.stderr)
        return 1
    inside = checkpoint_holding(os.path.dirname(os.path.abspath(args.output_prefix)))
    if inside is not None:  # e.g. a checkpoint's tokenizer/ folder: its tokenizer would be replaced
        print(f"error: --output-prefix {args.output_prefix} is inside the checkpoint folder {inside}: choose a "
              "folder outside it", file=sys.stderr)
        return 1
    try:
        model = train(args)
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 1
    print(f"Wrote {model} and {args.output_prefix}.vocab (vocab size {args.vocab_size})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
