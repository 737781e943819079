#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron-LM indexed datasets (``.bin``/``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --json-keys text \\
        --output-prefix out/corpus --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --append-eod --workers 2

Writes ``{output-prefix}_{key}_document.bin/.idx`` per JSON key: one document per input line
(one sequence per document, no sentence splitting; a document whose text tokenizes to nothing has
no sequence). ``--append-eod`` ends each non-empty document with the tokenizer's eod id. Token
dtype is uint16 if the vocabulary has < 65500 ids, else int32.

Input lines that are blank are ignored. A line that is not a JSON object, lacks a key, or whose
value is not a string is an error naming ``file:line`` (exit status 1), or with
``--skip-bad-lines`` is counted, reported and skipped. Outputs are written under temporary names
and renamed into place only after the whole input succeeded, so a failed run leaves nothing.

With ``--workers N > 1``, N processes each build their own tokenizer and encode batches of
lines; the parent reassembles batches in input order, so the output does not depend on N.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

import numpy as np

try:
    import megazero  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint.guard import checkpoint_holding  # noqa: E402
from megazero.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from megazero.data.tokenizers import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer  # noqa: E402
from megazero.config.failures import debug_requested, describe  # noqa: E402

BATCH_LINES = 64


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, optionally gzip-compressed (.gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="count and skip lines that are not JSON or lack a key, instead of failing")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model; HuggingFaceTokenizer: a folder or tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="append eod to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--log-interval", type=int, default=1000, help="print progress every this many documents")
    g.add_argument("--debug", action="store_true", help="print the traceback of a failure (also MEGAZERO_DEBUG=1)")
    return p.parse_args(argv)


class BadLine(Exception):
    """One input line that cannot be used (reported as file:line)."""


class LineEncoder:
    """Turns a batch of raw JSONL lines into token arrays; owns one tokenizer."""

    def __init__(self, args):
        self.keys, self.append_eod = list(args.json_keys), args.append_eod
        self.tokenizer = build_tokenizer(TokenizerConfig.from_flags(vars(args)))
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)

    def _parse(self, line: bytes) -> list[str]:
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadLine(f"not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
        texts = []
        for key in self.keys:
            if key not in obj:
                raise BadLine(f"missing key {key!r}")
            if not isinstance(obj[key], str):
                raise BadLine(f"value of {key!r} is {type(obj[key]).__name__}, not a string")
            texts.append(obj[key])
        return texts

    def encode(self, batch):
        """batch: list of (lineno, line). Returns list of (lineno, nbytes, error, arrays)."""
        parsed, out = [], []
        for lineno, line in batch:
            try:
                parsed.append((lineno, len(line), None, self._parse(line)))
            except BadLine as e:
                parsed.append((lineno, len(line), str(e), None))
        good = [texts for _, _, err, texts in parsed if err is None]
        many = getattr(self.tokenizer, "tokenize_batch", lambda c: [self.tokenizer.tokenize(t) for t in c])
        try:
            per_key = [many([texts[k] for texts in good]) for k in range(len(self.keys))]
        except (ValueError, TypeError, KeyError, OverflowError) as e:  # e.g. NullTokenizer: not an integer
            if len(batch) > 1:  # find the line: encode one by one
                return [r for item in batch for r in self.encode([item])]
            return [(batch[0][0], len(batch[0][1]), f"cannot be tokenized ({type(e).__name__}: {e})", None)]
        g = 0
        for lineno, nbytes, err, _ in parsed:
            if err is not None:
                out.append((lineno, nbytes, err, None))
                continue
            arrays = []
            for k in range(len(self.keys)):
                ids = per_key[k][g]
                if ids and self.append_eod:
                    ids = list(ids) + [self.tokenizer.eod]
                arrays.append(np.asarray(ids, dtype=self.dtype))
            out.append((lineno, nbytes, None, arrays))
            g += 1
        return out


def _worker(args, in_q, out_q):
    try:
        encoder = LineEncoder(args)
    except Exception:
        out_q.put((-1, None, traceback.format_exc()))
        return
    while True:
        item = in_q.get()
        if item is None:
            return
        batch_id, batch = item
        try:
            out_q.put((batch_id, encoder.encode(batch), None))
        except Exception:
            out_q.put((batch_id, None, traceback.format_exc()))


def _read_batches(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        batch = []
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            batch.append((lineno, line))
            if len(batch) == BATCH_LINES:
                yield batch
                batch = []
        if batch:
            yield batch


def _get_result(out_q, procs):
    """Next worker result; fails instead of hanging if a worker process died."""
    while True:
        try:
            return out_q.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"tokenizer worker exited with status {dead[0].exitcode}")


def _encoded_batches(args):
    """Yield encoded batches in input order, from this process or from worker processes."""
    if args.workers <= 1:
        encoder = LineEncoder(args)
        for batch in _read_batches(args.input):
            yield encoder.encode(batch)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    in_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(args, in_q, out_q), daemon=True)
             for _ in range(args.workers)]
    for proc in procs:
        proc.start()
    try:
        batches = enumerate(_read_batches(args.input))
        in_flight, next_id, pending, exhausted = 0, 0, {}, False
        while True:
            while not exhausted and in_flight < 4 * args.workers:
                item = next(batches, None)
                if item is None:
                    exhausted = True
                    break
                in_q.put(item)
                in_flight += 1
            if in_flight == 0:
                break
            batch_id, result, error = _get_result(out_q, procs)
            if error is not None:
                raise RuntimeError(f"tokenizer worker failed:\n{error}")
            pending[batch_id] = result
            in_flight -= 1
            while next_id in pending:
                yield pending.pop(next_id)
                next_id += 1
    finally:
        for _ in procs:
            in_q.put(None)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()


def preprocess(args) -> dict:
    """Run the conversion; returns a summary dict.

    A bad line without ``--skip-bad-lines`` raises SystemExit("error: FILE:LINE: what"); on any
    failure the temporary outputs are removed and earlier outputs are left untouched.
    """
    tokenizer = build_tokenizer(TokenizerConfig.from_flags(vars(args)))
    if args.append_eod and (tokenizer.eod is None or tokenizer.eod < 0):
        raise SystemExit(f"error: --append-eod: the {args.tokenizer_type} has no eod (eos) token")
    dtype = optimal_dtype(tokenizer.vocab_size)
    finals = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    temps = [(f + ".bin" + tag, f + ".idx" + tag) for f in finals]
    docs = bad = nbytes = ntokens = 0
    t0, ok, builders = time.perf_counter(), False, []
    try:
        builders.extend(IndexedDatasetBuilder(b, dtype) for b, _ in temps)
        with contextlib.closing(_encoded_batches(args)) as batches:
            for batch in batches:
                for lineno, size, error, arrays in batch:
                    nbytes += size
                    if error is not None:
                        if not args.skip_bad_lines:
                            raise SystemExit(f"error: {args.input}:{lineno}: {error}")
                        bad += 1
                        if bad <= 5:
                            print(f"warning: skipping {args.input}:{lineno}: {error}", file=sys.stderr)
                        continue
                    for builder, arr in zip(builders, arrays):
                        if arr.size:
                            builder.add_item(arr)
                        builder.end_document()
                        ntokens += arr.size
                    docs += 1
                    if args.log_interval > 0 and docs % args.log_interval == 0:
                        dt = time.perf_counter() - t0
                        print(f"Processed {docs} documents ({docs / dt:.1f} docs/s, "
                              f"{nbytes / dt / 1e6:.2f} MB/s).", file=sys.stderr, flush=True)
        if docs == 0:
            raise SystemExit(f"error: {args.input}: no documents ({bad} bad lines skipped, the rest "
                             "blank): nothing to train on")
        for builder, (_, idx_tmp) in zip(builders, temps):
            builder.finalize(idx_tmp)
        for final, (bin_tmp, idx_tmp) in zip(finals, temps):
            os.replace(bin_tmp, final + ".bin")
            os.replace(idx_tmp, final + ".idx")
        ok = True
    finally:
        if not ok:
            for builder in builders:
                with contextlib.suppress(OSError):  # a full disk fails the final flush too
                    builder.close()
            for path in [p for pair in temps for p in pair if os.path.exists(p)]:
                os.remove(path)
    return {"documents": docs, "skipped": bad, "bytes": nbytes, "tokens": ntokens,
            "seconds": time.perf_counter() - t0, "outputs": finals, "dtype": np.dtype(dtype).name}


def main(argv=None) -> int:
    args = get_args(argv)
    if not os.path.isfile(args.input):
        print(f"error: {args.input}: no such file", file=sys.stderr)
        return 1
    inside = checkpoint_holding(os.path.dirname(os.path.abspath(args.output_prefix)))
    if inside is not None:
        print(f"error: --output-prefix {args.output_prefix} is inside the checkpoint folder {inside}: choose a "
              "folder outside it", file=sys.stderr)
        return 1
    try:
        s = preprocess(args)
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 1
    except Exception as e:  # a full disk, a read-only folder, a tokenizer file: one line, nothing left behind
        if debug_requested(args.debug):
            raise
        print(f"error: {describe(e, default_file=args.output_prefix + '_*')}", file=sys.stderr)
        return 1
    rate = s["bytes"] / max(s["seconds"], 1e-9) / 1e6
    print(f"Done: {s['documents']} documents, {s['tokens']} tokens ({s['dtype']}), "
          f"{s['bytes'] / 1e6:.2f} MB in {s['seconds']:.2f} s ({rate:.2f} MB/s), "
          f"{s['skipped']} bad lines skipped.", file=sys.stderr)
    for prefix in s["outputs"]:
        print(f"Wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
