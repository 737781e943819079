"""GPT samples: epoch coverage, determinism, cache, builder/barrier, split, blending."""
import os
import threading

import numpy as np
import pytest

from megazero.data.gpt_dataset import (build_blending_indices, build_train_valid_test_datasets,
                                       parse_data_path, split_ranges)
from megazero.data.indexed_dataset import IndexedDatasetBuilder

S = 16


def make_unique_dataset(prefix, num_docs=60, base=0, seed=0):
    """Documents of random length (some empty) whose tokens are all distinct (base + k)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=num_docs)
    lengths[[3, 17]] = 0
    b = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    pos, docs = base, []
    for n in lengths:
        toks = np.arange(pos, pos + n, dtype=np.int32)
        pos += n
        if n:
            b.add_item(toks)
        b.end_document()
        docs.append(toks)
    b.finalize(prefix + ".idx")
    return docs


def _tokens(docs, rng):
    a, b = rng
    return np.concatenate([docs[i] for i in range(a, b)] + [np.zeros(0, np.int32)])


def test_one_epoch_covers_each_training_token_once(tmp_path):
    prefix = str(tmp_path / "u")
    docs = make_unique_dataset(prefix)
    (a, b), (c, d), (e, f) = split_ranges("8,1,1", len(docs))
    train_tokens = _tokens(docs, (a, b))
    n = (len(train_tokens) - 1) // S
    tr, va, te = build_train_valid_test_datasets([prefix], "8,1,1", S, 7, (n, 3, 2))
    assert len(tr) == n and tr.num_epochs == 1
    samples = np.stack([tr[i]["text"] for i in range(n)])
    assert samples.shape == (n, S + 1) and samples.dtype == np.int64
    inputs = samples[:, :-1].ravel()
    assert len(np.unique(inputs)) == len(inputs)             # nothing twice
    missing = np.setdiff1d(train_tokens, inputs)
    assert len(missing) < S                                   # only the epoch's tail
    assert np.isin(inputs, train_tokens).all()
    held_out = np.concatenate([_tokens(docs, (c, d)), _tokens(docs, (e, f))])
    assert not np.isin(samples, held_out).any()
    # labels are the next tokens of the stream: sample j's last token is sample j+1's first
    stream = [tr.unshuffled(j) for j in range(n)]
    assert all(stream[j][-1] == stream[j + 1][0] for j in range(n - 1))


def test_many_epochs_each_within_its_block(tmp_path):
    prefix = str(tmp_path / "u")
    docs = make_unique_dataset(prefix)
    train_tokens = _tokens(docs, split_ranges("1", len(docs))[0])
    T = len(train_tokens)
    n = (3 * T - 1) // S
    (tr, va, te) = build_train_valid_test_datasets([prefix], "1", S, 3, (n, 0, 0))
    assert va is None and te is None and tr.num_epochs == 3
    inputs = np.concatenate([tr[i]["text"][:-1] for i in range(n)])
    counts = np.bincount(inputs - train_tokens.min(), minlength=T)
    assert set(np.unique(counts)) <= {2, 3} and (counts == 2).sum() <= S
    # Training order finishes epoch e before epoch e+1: shuffled positions stay in-epoch.
    epoch = (np.asarray(tr.shuffle_index) * S) // T
    assert (np.diff(epoch) >= 0).all()
    # each epoch's document order is a permutation of all documents
    doc = np.asarray(tr.doc_index).reshape(3, -1)     # sequence ids (empty docs have none)
    assert all(sorted(row) == list(range(sum(len(x) > 0 for x in docs))) for row in doc)


def test_deterministic_in_seed_and_cached(tmp_path):
    prefix = str(tmp_path / "u")
    make_unique_dataset(prefix)
    args = ([prefix], "969,30,1", S, 11, (200, 10, 0))
    a = build_train_valid_test_datasets(*args, cache_dir=str(tmp_path / "c1"))[0]
    b = build_train_valid_test_datasets(*args, cache_dir=str(tmp_path / "c2"))[0]
    c = build_train_valid_test_datasets([prefix], "969,30,1", S, 12, (200, 10, 0),
                                        cache_dir=str(tmp_path / "c3"))[0]
    sa = [a[i]["text"].tolist() for i in range(200)]
    assert sa == [b[i]["text"].tolist() for i in range(200)]
    assert sa != [c[i]["text"].tolist() for i in range(200)]
    files = sorted(os.listdir(tmp_path / "c1"))
    assert len([f for f in files if f.endswith(".npy")]) == 6 and not any("tmp" in f
                                                                          for f in files)
    mtimes = {f: os.path.getmtime(tmp_path / "c1" / f) for f in files}
    again = build_train_valid_test_datasets(*args, cache_dir=str(tmp_path / "c1"))[0]
    assert {f: os.path.getmtime(tmp_path / "c1" / f) for f in files} == mtimes
    assert [again[i]["text"].tolist() for i in range(200)] == sa
    # default cache dir sits next to the data
    build_train_valid_test_datasets(*args)
    assert os.path.isdir(tmp_path / "index-cache")


def test_one_builder_others_wait(tmp_path):
    prefix = str(tmp_path / "u")
    make_unique_dataset(prefix)
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="no rank built it"):
        build_train_valid_test_datasets([prefix], "1", S, 1, (50, 0, 0), cache_dir=cache,
                                        is_builder=False)
    barrier = threading.Barrier(3)
    results = [None] * 3

    def rank(r):
        results[r] = build_train_valid_test_datasets(
            [prefix], "1", S, 1, (50, 0, 0), cache_dir=cache, is_builder=(r == 0),
            barrier=barrier.wait)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(res is not None for res in results)
    ref = [results[0][i]["text"].tolist() for i in range(50)]
    assert all([res[i]["text"].tolist() for i in range(50)] == ref for res in results[1:])


def test_split_ranges_and_data_path():
    assert split_ranges("969,30,1", 1189) == [(0, 1152), (1152, 1188), (1188, 1189)]
    assert split_ranges("969, 30, 1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1/1/1", 10) == [(0, 4), (4, 7), (7, 10)]  # Megatron's rounding
    assert parse_data_path(["A"]) == (["A"], [1.0])
    assert parse_data_path(["3", "A", "1", "B"]) == (["A", "B"], [0.75, 0.25])
    with pytest.raises(ValueError):
        parse_data_path(["0.3", "A", "B"])


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.2, 0.3, 0.5],
                                     [0.01, 0.09, 0.4, 0.5], [1 / 3, 1 / 3, 1 / 3]])
def test_blending_within_one_sample_at_every_prefix(weights):
    n = 20000
    which, nth = build_blending_indices(weights, n)
    onehot = np.eye(len(weights), dtype=np.int64)[which]
    counts = np.cumsum(onehot, axis=0)                       # c_j after each prefix
    expected = np.arange(1, n + 1)[:, None] * np.asarray(weights)[None, :]
    assert np.abs(counts - expected).max() <= 1.0
    # nth is the running count of the chosen dataset
    assert (nth == counts[np.arange(n), which] - 1).all()


def test_blended_datasets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_unique_dataset(a, base=0, seed=1)
    make_unique_dataset(b, base=1_000_000, seed=2)
    n = 300
    tr, va, te = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0", S, 5,
                                                 (n, 20, 5))
    assert te is None and len(tr) == n and len(va) == 20
    src = np.array([int(tr[i]["text"][0] >= 1_000_000) for i in range(n)])
    same = np.array([(tr[i]["text"] >= 1_000_000).all() or (tr[i]["text"] < 1_000_000).all()
                     for i in range(n)])
    assert same.all()
    frac_b = np.cumsum(src) / np.arange(1, n + 1)
    assert np.abs(np.cumsum(src) - 0.7 * np.arange(1, n + 1)).max() <= 1.0
    assert abs(frac_b[-1] - 0.7) < 0.01
    # each sub-dataset has exactly the samples the blend uses
    assert [len(d) for d in tr.datasets] == np.bincount(np.asarray(tr.dataset_index)).tolist()


def test_empty_splits_are_none(tmp_path):
    prefix = str(tmp_path / "u")
    make_unique_dataset(prefix, num_docs=20)
    tr, va, te = build_train_valid_test_datasets([prefix], "1,0,0", S, 1, (4, 4, 4))
    assert tr is not None and va is None and te is None
    tr, va, te = build_train_valid_test_datasets([prefix], "1,1,0", S, 1, (4, 0, 4))
    assert tr is not None and va is None and te is None
