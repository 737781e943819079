"""Peer tests against megatron-core 0.16.1 (``make peers``): ``.bin/.idx`` files written by its
``IndexedDatasetBuilder`` (megatron/core/datasets/indexed_dataset.py) read through megazero's
reader give the same tokens, sequences and documents, and the other way round; megazero's
``weights_only`` allow-list for Megatron rank files covers every non-Megatron class of
megatron-core's own ``SAFE_GLOBALS`` (megatron/core/safe_globals.py)."""
import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron peer suite runs under `make peers`")

from megatron.core.datasets import indexed_dataset as mt  # noqa: E402

from megazero.data import indexed_dataset as mz  # noqa: E402


def documents(seed: int, vocab: int):
    g = np.random.default_rng(seed)
    return [[g.integers(0, vocab, int(g.integers(1, 40))) for _ in range(int(g.integers(1, 4)))] for _ in range(12)]


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50000), (np.int32, 100000)])
def test_megatron_builder_read_by_megazero(tmp_path, dtype, vocab):
    docs, prefix = documents(1, vocab), str(tmp_path / "mt_text_document")
    builder = mt.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, doc in enumerate(docs):
        if i % 2:  # both of Megatron's ways of adding a document
            builder.add_document(torch.from_numpy(np.concatenate(doc)), [len(s) for s in doc])
        else:
            for seq in doc:
                builder.add_item(torch.from_numpy(seq.astype(np.int64)))
            builder.end_document()
    builder.finalize(prefix + ".idx")
    ours = mz.IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(ours) == len(flat) and ours.num_documents == len(docs) and ours.dtype == dtype
    for i, seq in enumerate(flat):
        assert np.array_equal(ours.get(i), seq)
    i = next(k for k, seq in enumerate(flat) if len(seq) >= 3)
    assert np.array_equal(ours.get(i, 1, 2), flat[i][1:3])
    theirs = mt.IndexedDataset(prefix)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)


def test_megazero_builder_read_by_megatron(tmp_path):
    docs, prefix = documents(2, 30000), str(tmp_path / "mz_text_document")
    builder = mz.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    theirs = mt.IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(theirs) == len(flat) and len(theirs.document_indices) == len(docs) + 1
    for i, seq in enumerate(flat):
        assert np.array_equal(theirs[i], seq)


def test_allow_list_covers_megatrons_safe_globals():
    from megatron.core.safe_globals import SAFE_GLOBALS

    from megazero.checkpoint.convert.megatron_pickle import ALLOWED
    names = {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS}
    foreign = {n for n in names if not n.startswith("megatron.")}
    assert foreign <= set(ALLOWED), foreign - set(ALLOWED)
