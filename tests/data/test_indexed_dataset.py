"""IndexedDataset: files from an independent writer of the published format, and bad files."""
import os
import struct

import numpy as np
import pytest

from megazero.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                           IndexedDatasetError)

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
         np.float32: 7, np.uint16: 8}


def independent_write(prefix, documents, dtype):
    """Writes Megatron's MMIDIDX v1 format by hand. documents: list of lists of sequences."""
    seqs = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    lengths = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    return seqs, doc_idx


DOCS = [[[1, 2, 3], [4, 5]], [[6]], [], [[], [7, 8, 9, 10]], [[65000, 0, 11]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_independent_writer_loads_token_exact(tmp_path, dtype):
    prefix = str(tmp_path / "ds")
    seqs, doc_idx = independent_write(prefix, DOCS, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(seqs) == 6 and ds.num_documents == len(DOCS)
    assert ds.document_indices.tolist() == doc_idx
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s.tolist()
    assert ds[-1].tolist() == [65000, 0, 11]
    assert ds.get(4, 1, 2).tolist() == [8, 9]
    assert ds.get(4, 3).tolist() == [10]
    assert [a.tolist() for a in ds[0:2]] == [[1, 2, 3], [4, 5]]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)
    with pytest.raises(IndexError):
        ds[6]


def test_builder_writes_the_same_bytes(tmp_path):
    ref = str(tmp_path / "ref")
    independent_write(ref, DOCS, np.uint16)
    out = str(tmp_path / "out")
    b = IndexedDatasetBuilder(out + ".bin", np.uint16)
    for doc in DOCS:
        for s in doc:
            b.add_item(s)
        b.end_document()
    b.finalize(out + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ref + ext, "rb").read() == open(out + ext, "rb").read()


def test_builder_rejects_ids_outside_dtype(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="range"):
        b.add_item([70000])
    b.close()


def _corrupt(tmp_path, mutate, ext=".idx"):
    prefix = str(tmp_path / "ds")
    independent_write(prefix, DOCS, np.uint16)
    path = prefix + ext
    data = bytearray(open(path, "rb").read())
    with open(path, "wb") as f:
        f.write(mutate(data))
    return prefix, path


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[:-3], "truncated"),
    (lambda d: d[:20], "truncated"),
    (lambda d: d[:4], "truncated"),
    (lambda d: b"", "truncated"),
    (lambda d: d + b"\0", "trailing bytes"),
    (lambda d: b"NOTANIDX!" + d[9:], "wrong magic"),
    (lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "unknown version 2"),
    (lambda d: d[:17] + bytes([9]) + d[18:], "unknown dtype code 9"),
    (lambda d: d[:-8] + struct.pack("<q", 3), "document indices"),
])
def test_corrupt_index_names_file_and_problem(tmp_path, mutate, message):
    prefix, path = _corrupt(tmp_path, mutate)
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix)
    assert path in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[:-1], "truncated"), (lambda d: d + b"\0\0", "trailing bytes")])
def test_corrupt_bin_names_file_and_problem(tmp_path, mutate, message):
    prefix, path = _corrupt(tmp_path, mutate, ext=".bin")
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix)
    assert path in str(e.value) and message in str(e.value)


def test_missing_file(tmp_path):
    prefix = str(tmp_path / "ds")
    independent_write(prefix, DOCS, np.uint16)
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin: no such file"):
        IndexedDataset(prefix)
