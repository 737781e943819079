"""Checks of training data, each failing with one :class:`DataError` line naming the file, and the
index-cache files they guard.

* Token ids must lie in ``[0, vocab_size)``: checked per sample when it is read (a vectorized
  max over its S+1 tokens viewed as unsigned, 5-15 microseconds at S = 4096, within the noise of
  reading the sample) and, when a split is built, over the whole split if it has at most :data:`SCAN_TOKENS`
  tokens and its dtype can hold an id outside the vocabulary. The error names the dataset prefix,
  the document, the sequence and the id.
* Index caches (``.npy``): a cache folder that is a file, or a cache file that cannot be read
  (truncated, corrupt), is named with the cause and the remedy (delete it: it is rebuilt).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np

from megazero.data.indexed_dataset import DataError, IndexedDataset

SCAN_TOKENS = 1 << 27  # splits up to this many tokens are checked against the vocabulary when built


def check_ids(tokens: np.ndarray, vocab_size: int | None, indexed: IndexedDataset, first_token: int = 0,
              sequences=None) -> None:
    """Raise :class:`DataError` naming the dataset, document and id if any id is outside
    ``[0, vocab_size)``; ``tokens`` start at flat position ``first_token`` of ``indexed`` (or, for a
    sample, come from ``sequences`` = [(sequence, its token count)] in order). One vectorized max."""
    if vocab_size is None or tokens.size == 0:
        return
    unsigned = tokens.view(np.dtype(f"u{tokens.dtype.itemsize}")) if tokens.dtype.kind == "i" else tokens
    if int(unsigned.max()) < vocab_size:  # one pass: a negative id reads as a huge unsigned one
        return
    pos = int(np.flatnonzero((tokens >= vocab_size) | (tokens < 0))[0])
    if sequences is None:
        seq = indexed.sequence_at(first_token + pos)
    else:
        ends = np.cumsum([n for _, n in sequences])
        seq = sequences[int(np.searchsorted(ends, pos, side="right"))][0]
    raise DataError(f"{indexed.path_prefix}: document {indexed.document_of(seq)} (sequence {seq}) holds token id "
                    f"{int(tokens[pos])}, outside the vocabulary of {vocab_size} ids (preprocessed with another "
                    "tokenizer?)")


def can_hold_bad_ids(indexed: IndexedDataset, vocab_size: int) -> bool:
    """Whether the token dtype can hold an id outside the vocabulary (else nothing to scan)."""
    info = np.iinfo(indexed.dtype) if indexed.dtype.kind in "iu" else None
    return info is None or info.max >= vocab_size or info.min < 0


def cached_arrays(cache_dir: str, name: str, key: dict, build: Callable[[], dict],
            is_builder: bool, barrier: Callable[[], None] | None) -> dict:
    """Load arrays ``name-<hash>-<field>.npy`` from cache_dir, building them if missing.

    The builder writes each file under a temporary name then renames it, plus a ``.json`` with
    the key for humans. Every rank calls ``barrier`` once (if given) before loading.
    """
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise DataError(f"index cache folder {cache_dir} (--data-cache-path) is a file")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(cache_dir, f"{name}-{digest}")
    fields = key["fields"]
    paths = {f: f"{base}-{f}.npy" for f in fields}
    if is_builder and not all(os.path.isfile(p) for p in paths.values()):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        for f, p in paths.items():
            tmp = f"{p}.tmp-{os.getpid()}.npy"
            np.save(tmp, arrays[f])
            os.replace(tmp, p)
        with open(base + ".json", "w") as fh:
            json.dump(key, fh, indent=1)
    if barrier is not None:
        barrier()
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"index cache {missing[0]} is missing (no rank built it: "
                                "pass is_builder=True on one rank and a barrier)")
    return {f: _load_cached(p) for f, p in paths.items()}


def _load_cached(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"index cache {path} cannot be read ({e}): truncated or corrupt; delete it and it is "
                        "rebuilt") from None
