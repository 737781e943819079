"""A small byte-level BPE trainer that writes GPT-2-format ``vocab.json`` / ``merges.txt``.

For tests and benchmarks without network access to GPT-2's own files. Training: split text with
GPT-2's pattern, map each piece's UTF-8 bytes through GPT-2's byte table, count words; then
repeat ``num_merges`` times: take the most frequent adjacent symbol pair (ties: the smallest
pair in string order), record it as the next merge, and merge it (left to right,
non-overlapping) in every word containing it. Pair counts are kept incrementally (a heap with
lazy invalidation), so only words containing the merged pair are revisited.

Vocabulary ids: the 256 byte characters in byte order, then each new merged symbol in merge
order, then ``<|endoftext|>``.
"""
from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from typing import Iterable

from megazero.data.tokenizers import GPT2_EOD, GPT2_PATTERN, bytes_to_unicode, merge_pair

__all__ = ["train_byte_level_bpe", "write_gpt2_files"]


def train_byte_level_bpe(texts: Iterable[str], num_merges: int, min_frequency: int = 2):
    """Returns (vocab: dict[str, int], merges: list[tuple[str, str]])."""
    import regex

    pattern = regex.compile(GPT2_PATTERN)
    table = bytes_to_unicode()
    counts: Counter = Counter()
    for text in texts:
        counts.update(pattern.findall(text))
    words = [[table[b] for b in piece.encode("utf-8")] for piece in counts]
    freqs = list(counts.values())
    pair_count: Counter = Counter()
    where: dict = defaultdict(set)
    for wi, syms in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] += freqs[wi]
            where[pair].add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < num_merges:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < min_frequency:
            break
        merges.append(pair)
        changed = set()
        for wi in list(where.pop(pair, ())):
            syms, f = words[wi], freqs[wi]
            for p in zip(syms, syms[1:]):
                pair_count[p] -= f
                changed.add(p)
            syms = words[wi] = merge_pair(syms, *pair)
            for p in zip(syms, syms[1:]):
                pair_count[p] += f
                where[p].add(wi)
                changed.add(p)
        pair_count.pop(pair, None)
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[table[b]] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[GPT2_EOD] = len(vocab)
    return vocab, merges


def write_gpt2_files(vocab: dict, merges: list, vocab_file: str, merge_file: str) -> None:
    """Write vocab.json and merges.txt (with GPT-2's ``#version: 0.2`` header line)."""
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
