"""GPT training samples over indexed datasets: split, shuffle, blend, cache.

A split is a contiguous range of documents ``[d0, d1)`` of an :class:`IndexedDataset`, i.e.
sequences ``[doc_idx[d0], doc_idx[d1])``; call their token count T (one epoch). With sample
length S = seq_length, sample i is tokens ``[i*S, i*S + S]`` (S+1 tokens: inputs and shifted
labels; consecutive samples share one token) of the stream made by concatenating epochs, each
epoch being all the split's sequences in an independent random order. Hence

* epochs E = ceil((N*S + 1) / T) for N samples, and the inputs (first S tokens) of samples
  whose start lies in epoch e cover that epoch's tokens exactly once (a partial sample at the
  epoch's end continues into the next);
* ``doc_index``   (E * n_seq,)  sequence ids, epoch by epoch, each epoch a permutation;
* ``sample_index`` (N, 2)       (position in doc_index, token offset) of each sample's start,
  from ``searchsorted(cumsum(lengths[doc_index]), i*S, 'right') - 1``: no per-token loops;
* ``shuffle_index`` (N,)        a permutation of samples *within* each epoch, so training
  order visits a whole epoch before the next.

All three come from ``numpy.random.default_rng([seed, stream])``, are cached as ``.npy`` under a
name keyed by the SHA-256 of everything they depend on (format version, the split's sequence
lengths, S, N, seed), and are built by one rank (``is_builder``) while others wait in
``barrier()``.

Blending (``--data-path 0.3 A 0.7 B``): sample i of the blend comes from dataset
``argmax_j(w_j * (i+1) - c_j(i))`` (c_j = samples already taken from j; ties -> lowest j), the
greedy "largest error" rule, which keeps every prefix within one sample of the weights.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Callable, Sequence

import numpy as np

from megazero.data.data_checks import SCAN_TOKENS, cached_arrays, can_hold_bad_ids, check_ids
from megazero.data.indexed_dataset import DataError, IndexedDataset

__all__ = ["GPTDataset", "BlendedDataset", "build_train_valid_test_datasets",
           "parse_data_path", "parse_split", "split_ranges", "build_doc_index",
           "build_sample_index", "build_shuffle_index", "build_blending_indices"]

INDEX_VERSION = 1
# bytes of index a GPTDataset keeps per sample: sample_index (2 x int64) + shuffle_index (int64);
# doc_index, a blend's indices and the build's temporaries come on top
INDEX_BYTES_PER_SAMPLE = 24


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1') -> three fractions summing to 1."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or not all(p >= 0 and math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise DataError(f"--split {split!r}: expected up to three finite non-negative weights such as 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(split: str, n: int) -> list[tuple[int, int]]:
    """Cut n documents into three contiguous ranges by the split weights (Megatron's rounding:
    boundaries at round(cumulative fraction * n), the last forced to n)."""
    bounds = [0]
    for frac in parse_split(split):
        bounds.append(bounds[-1] + int(round(frac * n)))
    excess = bounds[-1] - n
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """['A'] -> ([A], [1.0]); ['0.3', 'A', '0.7', 'B'] -> ([A, B], [0.3, 0.7]) normalized."""
    data_path = list(data_path)
    if len(data_path) == 1:
        return data_path, [1.0]
    if len(data_path) % 2:
        raise ValueError("--data-path: expected one prefix or weight/prefix pairs")
    weights = [float(w) for w in data_path[0::2]]
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError("--data-path: weights must be non-negative and not all zero")
    return data_path[1::2], [w / sum(weights) for w in weights]


def build_doc_index(seq_ids: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """Epoch after epoch, an independent permutation of seq_ids."""
    rng = np.random.default_rng([seed, 0])
    dtype = np.int32 if len(seq_ids) == 0 or seq_ids.max() < 2**31 - 1 else np.int64
    out = np.empty(num_epochs * len(seq_ids), dtype=dtype)
    for e in range(num_epochs):
        out[e * len(seq_ids):(e + 1) * len(seq_ids)] = seq_ids[rng.permutation(len(seq_ids))]
    return out


def build_sample_index(lengths: np.ndarray, doc_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """(num_samples, 2) int64: (position in doc_index, offset) of token i*seq_length."""
    cum = np.zeros(len(doc_index) + 1, dtype=np.int64)
    np.cumsum(lengths[doc_index], out=cum[1:])
    if num_samples * seq_length + 1 > cum[-1]:
        raise ValueError("not enough tokens for the requested samples")
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right") - 1
    return np.stack([pos, starts - cum[pos]], axis=1)


def build_shuffle_index(num_samples: int, seq_length: int, tokens_per_epoch: int,
                        seed: int) -> np.ndarray:
    """A permutation of range(num_samples) that shuffles samples within their epoch.

    Sample j starts at token j*S, in epoch floor(j*S / T); epoch e's samples are the contiguous
    range [ceil(e*T/S), ceil((e+1)*T/S)). Few epochs: one permutation per epoch; many (tiny
    data): one argsort of (epoch + uniform[0,1)) keys.
    """
    rng = np.random.default_rng([seed, 1])
    S, T, N = seq_length, tokens_per_epoch, num_samples
    num_epochs = -(-(N * S) // T) + 1
    bounds = np.unique(np.minimum(-(-np.arange(num_epochs + 1, dtype=np.int64) * T // S), N))
    if len(bounds) > 4096:
        epoch = np.arange(N, dtype=np.int64) * S // T
        return np.argsort(epoch + rng.random(N), kind="stable").astype(np.int64)
    out = np.empty(N, dtype=np.int64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = a + rng.permutation(b - a)
    return out


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy largest-error assignment: (dataset_index uint8/int16, dataset_sample_index int64).

    A loop over samples in plain Python (~0.5 s per million); the result is cached.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(size, dtype=np.int16)
    nth = np.empty(size, dtype=np.int64)
    rng_j = range(1, len(w))
    for i in range(size):
        best, best_err = 0, w[0] * (i + 1) - counts[0]
        for j in rng_j:
            err = w[j] * (i + 1) - counts[j]
            if err > best_err:
                best, best_err = j, err
        which[i] = best
        nth[i] = counts[best]
        counts[best] += 1
    return which, nth


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens from one split of one dataset."""

    def __init__(self, indexed: IndexedDataset, name: str, doc_range: tuple[int, int],
                 seq_length: int, num_samples: int, seed: int, cache_dir: str,
                 is_builder: bool = True, barrier: Callable[[], None] | None = None, vocab_size: int | None = None):
        self.indexed, self.name, self.seq_length = indexed, name, int(seq_length)
        self.vocab_size = vocab_size  # ids checked per sample, and when built for splits up to SCAN_TOKENS
        self.num_samples = int(num_samples)
        docs = indexed.document_indices
        s0, s1 = int(docs[doc_range[0]]), int(docs[doc_range[1]])
        self.lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
        seq_ids = np.arange(s0, s1, dtype=np.int64)
        self.tokens_per_epoch = int(self.lengths[s0:s1].sum())
        if self.tokens_per_epoch <= 1 or self.num_samples <= 0:
            raise ValueError(f"{name}: split has {self.tokens_per_epoch} tokens for "
                             f"{self.num_samples} samples")
        if vocab_size is not None and can_hold_bad_ids(indexed, vocab_size) and self.tokens_per_epoch <= SCAN_TOKENS:
            check_ids(indexed.tokens_of(s0, s1), vocab_size, indexed, int(indexed.sequence_pointers[s0])
                      // indexed.dtype.itemsize if s1 > s0 else 0)
        S, N, T = self.seq_length, self.num_samples, self.tokens_per_epoch
        self.num_epochs = -(-(N * S + 1) // T)
        key = {"version": INDEX_VERSION, "fields": ["doc", "sample", "shuffle"],
               "prefix": os.path.basename(indexed.path_prefix), "split": name,
               "sequences": [s0, s1], "seq_length": S, "num_samples": N, "seed": int(seed),
               "lengths_sha256": hashlib.sha256(self.lengths[s0:s1].tobytes()).hexdigest()}

        def build():
            doc = build_doc_index(seq_ids, self.num_epochs, seed)
            return {"doc": doc, "sample": build_sample_index(self.lengths, doc, S, N),
                    "shuffle": build_shuffle_index(N, S, T, seed)}

        stem = f"{os.path.basename(indexed.path_prefix)}-{name}"
        arrays = cached_arrays(cache_dir, stem, key, build, is_builder, barrier)
        self.doc_index, self.sample_index = arrays["doc"], arrays["sample"]
        self.shuffle_index = arrays["shuffle"]

    def __len__(self) -> int:
        return self.num_samples

    def unshuffled(self, j: int) -> np.ndarray:
        """Sample j in stream order (before the shuffle index): S+1 int64 tokens."""
        pos, offset = (int(x) for x in self.sample_index[j])
        need = self.seq_length + 1
        parts, seqs = [], []
        while need > 0:
            seq = int(self.doc_index[pos])
            take = min(need, int(self.lengths[seq]) - offset)
            if take > 0:
                parts.append(self.indexed.get(seq, offset, take))
                seqs.append((seq, take))
                need -= take
            pos, offset = pos + 1, 0
        tokens = np.concatenate(parts).astype(np.int64)
        check_ids(tokens, self.vocab_size, self.indexed, sequences=seqs)
        return tokens

    def __getitem__(self, i: int) -> dict:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples}")
        return {"text": self.unshuffled(int(self.shuffle_index[i]))}


class BlendedDataset:
    """Blend sample i is ``datasets[dataset_index[i]][dataset_sample_index[i]]`` (see
    :func:`build_blending_indices` for how the indices are chosen)."""

    def __init__(self, datasets: list, weights: Sequence[float], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray):
        self.datasets, self.weights = datasets, list(weights)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int,
                                    seed: int, train_valid_test_num_samples: tuple[int, int, int],
                                    cache_dir: str | None = None, is_builder: bool = True,
                                    barrier: Callable[[], None] | None = None, vocab_size: int | None = None):
    """(train, valid, test) datasets, None where a split is empty or asks for 0 samples.

    ``data_path`` is Megatron's ``--data-path`` list; ``cache_dir`` defaults to
    ``<directory of the first prefix>/index-cache``. With several prefixes each split is the
    blend of the same split of every dataset that has one; a dataset whose split is empty is
    left out of that blend and the remaining weights renormalized.
    """
    prefixes, weights = parse_data_path(data_path)
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    indexed = [IndexedDataset(p) for p in prefixes]
    for ds in indexed:
        if ds.num_tokens <= 1:
            raise DataError(f"{ds.path_prefix}.bin/.idx: the dataset is empty ({ds.num_documents} documents, "
                            f"{ds.num_tokens} tokens)")
    names = ["train", "valid", "test"]
    out = []
    for k, (split_name, n) in enumerate(zip(names, train_valid_test_num_samples)):
        n = int(n)
        parts = []
        for ds, w in zip(indexed, weights):
            d0, d1 = split_ranges(split, ds.num_documents)[k]
            docs = ds.document_indices
            tokens = int(ds.sequence_lengths[docs[d0]:docs[d1]].sum()) if d1 > d0 else 0
            if tokens > 1 and w > 0:
                parts.append((ds, (d0, d1), w))
        if n <= 0 or not parts:
            out.append(None)
            continue
        if len(parts) == 1:
            ds, rng, _ = parts[0]
            out.append(GPTDataset(ds, split_name, rng, seq_length, n, seed, cache_dir,
                                  is_builder, barrier, vocab_size))
            continue
        total = sum(p[2] for p in parts)
        ws = [p[2] / total for p in parts]
        key = {"version": INDEX_VERSION, "fields": ["which", "nth"], "weights": ws, "size": n,
               "parts": [[os.path.abspath(p[0].path_prefix), list(p[1])] for p in parts]}
        idx = cached_arrays(cache_dir, f"blend-{split_name}", key,
                      lambda: dict(zip(["which", "nth"], build_blending_indices(ws, n))),
                      is_builder, barrier)
        counts = np.bincount(np.asarray(idx["which"]), minlength=len(parts))
        subs = [GPTDataset(ds, split_name, rng, seq_length, max(int(c), 1), seed, cache_dir,
                           is_builder, barrier, vocab_size) for (ds, rng, _), c in zip(parts, counts)]
        out.append(BlendedDataset(subs, ws, idx["which"], idx["nth"]))
    return tuple(out)
