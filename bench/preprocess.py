#!/usr/bin/env python
"""Data-pipeline benchmark: preprocessing throughput and sample-index build time.

    python bench/preprocess.py [--input data/kjv.jsonl.gz] [--num-samples 10000000]

Measures, on the bundled corpus (uncompressed JSON bytes / wall seconds of the whole
``tools/preprocess_data.py`` command, interpreter start-up included):

* SentencePiece (unigram, vocab 4096, trained here by tools/train_tokenizer.py) with 1 and 2
  workers;
* GPT-2 byte-level BPE with 1 and 2 workers. GPT-2's own vocab.json/merges.txt cannot be
  downloaded here, so a byte-level BPE (``--bpe-merges`` merges) is trained on the corpus by
  ``megazero.data.bpe_trainer``; the tokenizer code path is the same as for GPT-2's files.
  Peer: HuggingFace ``tokenizers`` (Rust) on the same files, single-threaded, if installed.
* building the doc/sample/shuffle indices for ``--num-samples`` samples of ``--seq-length``
  over the corpus (cache writing included), and the greedy blending index for two datasets.

Targets (issue 3): SentencePiece preprocessing < 10 s on 2 cores; 10M-sample index < 5 s.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), *args],
                       capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{script} failed:\n{r.stderr}")
    return dt


def _tokenizer_rows(args, texts, tmp) -> tuple[list, dict]:
    """Train both tokenizers; returns the timing rows and each kind's preprocess_data.py flags."""
    from megazero.data.bpe_trainer import train_byte_level_bpe, write_gpt2_files
    rows = []
    t = run("train_tokenizer.py", "--input", args.input, "--vocab-size", "4096", "--output-prefix", f"{tmp}/sp")
    rows.append(("train sentencepiece (vocab 4096)", t, None))
    t0 = time.perf_counter()
    vocab, merges = train_byte_level_bpe(texts, args.bpe_merges)
    write_gpt2_files(vocab, merges, f"{tmp}/vocab.json", f"{tmp}/merges.txt")
    rows.append((f"train byte-level BPE ({len(vocab)} ids)", time.perf_counter() - t0, None))
    kinds = {"sentencepiece": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", f"{tmp}/sp.model"],
             "gpt2-bpe": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{tmp}/vocab.json",
                          "--merge-file", f"{tmp}/merges.txt"]}
    return rows, kinds


def _preprocess_rows(args, raw: bytes, mb: float, kinds: dict, tmp: str) -> list:
    """preprocess_data.py per tokenizer and worker count, on the corpus and on ``--scale`` copies."""
    rows = []
    for name, flags in kinds.items():
        for w in args.workers:
            t = run("preprocess_data.py", "--input", args.input, "--output-prefix",
                    f"{tmp}/{name}{w}", "--append-eod", "--workers", str(w), *flags)
            rows.append((f"preprocess {name}, {w} worker(s)", t, mb / t))
    if args.scale > 1:
        big = f"{tmp}/big.jsonl"
        with open(big, "wb") as f:
            for _ in range(args.scale):
                f.write(raw)
        for name, flags in kinds.items():
            for w in args.workers:
                t = run("preprocess_data.py", "--input", big, "--output-prefix",
                        f"{tmp}/big-{name}{w}", "--append-eod", "--workers", str(w), *flags)
                rows.append((f"preprocess {name}, {w} worker(s), corpus x{args.scale} (plain JSONL)",
                             t, args.scale * mb / t))
    return rows


def _hf_peer_row(texts, mb: float, tmp: str) -> tuple:
    """The peer: Hugging Face ``tokenizers`` encoding with the same BPE files (when installed)."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return ("peer: HF tokenizers not installed", float("nan"), None)
    hf = Tokenizer(models.BPE.from_file(f"{tmp}/vocab.json", f"{tmp}/merges.txt"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    os.environ["RAYON_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    for text in texts:
        hf.encode(text)
    t = time.perf_counter() - t0
    return ("peer: HF tokenizers (Rust) BPE encode only, 1 thread", t, mb / t)


def _index_rows(args, tmp: str) -> list:
    """Dataset index build, cached load, random reads and a blending index."""
    import numpy as np

    from megazero.data.gpt_dataset import build_blending_indices, build_train_valid_test_datasets
    rows = []
    prefix = f"{tmp}/sentencepiece{args.workers[0]}_text_document"
    counts = (args.num_samples, 0, 0)
    t0 = time.perf_counter()
    tr, _, _ = build_train_valid_test_datasets([prefix], "969,30,1", args.seq_length, 1234, counts,
                                               cache_dir=f"{tmp}/cache")
    rows.append((f"index build: {args.num_samples:,} samples x {args.seq_length} "
                 f"({tr.num_epochs} epochs), incl. .npy writes", time.perf_counter() - t0, None))
    t0 = time.perf_counter()
    build_train_valid_test_datasets([prefix], "969,30,1", args.seq_length, 1234, counts, cache_dir=f"{tmp}/cache")
    rows.append(("index load from cache", time.perf_counter() - t0, None))
    t0 = time.perf_counter()
    for i in range(0, len(tr), max(1, len(tr) // 10000))[:10000]:
        tr[i]
    rows.append(("10,000 random samples read", time.perf_counter() - t0, None))
    t0 = time.perf_counter()
    which, _ = build_blending_indices([0.3, 0.7], args.num_samples)
    rows.append((f"blending index, 2 datasets, {args.num_samples:,} samples", time.perf_counter() - t0, None))
    assert abs(np.mean(which) - 0.7) < 1e-3
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", default=os.path.join(ROOT, "data", "kjv.jsonl.gz"))
    p.add_argument("--num-samples", type=int, default=10_000_000)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--bpe-merges", type=int, default=4000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--scale", type=int, default=8,
                   help="also time a plain-JSONL copy of the corpus repeated this many times "
                        "(worker scaling shows on bigger inputs; 0 to skip)")
    args = p.parse_args()
    with gzip.open(args.input, "rb") as f:
        raw = f.read()
    mb = len(raw) / 1e6
    texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    results = {"input": os.path.relpath(args.input, ROOT), "input_MB": round(mb, 3),
               "documents": len(texts), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        rows, kinds = _tokenizer_rows(args, texts, tmp)
        rows += _preprocess_rows(args, raw, mb, kinds, tmp)
        rows.append(_hf_peer_row(texts, mb, tmp))
        rows += _index_rows(args, tmp)
    print(f"corpus {results['input']}: {results['documents']} documents, {mb:.2f} MB JSON, "
          f"{results['cpus']} CPUs")
    for name, t, rate in rows:
        extra = f"  {rate:7.2f} MB/s" if rate else ""
        print(f"  {name:<72} {t:8.2f} s{extra}")
    results["rows"] = [{"name": n, "seconds": round(t, 4), "MB_per_s": r and round(r, 3)}
                       for n, t, r in rows]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
