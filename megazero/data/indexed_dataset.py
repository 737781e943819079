"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``), read and written.

``{prefix}.bin`` is every sequence's token ids back to back, little-endian, in one dtype, no
header. ``{prefix}.idx`` (all integers little-endian)::

    offset  size     field
    0       9        magic  b"MMIDIDX\\x00\\x00"
    9       8        version, <Q, = 1
    17      1        dtype code, <B: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                     6 float64, 7 float32, 8 uint16
    18      8        S = number of sequences, <Q
    26      8        D = number of document indices, <Q  (= number of documents + 1)
    34      4*S      sequence lengths in tokens, int32
    34+4S   8*S      sequence pointers: byte offset of each sequence in .bin, int64
                     (pointer[0] = 0, pointer[k+1] = pointer[k] + length[k] * itemsize)
    34+12S  8*D      document indices, int64: document d is sequences
                     [doc_idx[d], doc_idx[d+1]); doc_idx[0] = 0, doc_idx[-1] = S

File size of .idx is exactly 34 + 12*S + 8*D bytes; of .bin, sum(lengths) * itemsize.
Token dtype is uint16 when the vocabulary has fewer than 65500 ids, else int32.
"""
from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "IndexedDatasetError", "DataError", "DTYPES",
           "dtype_code", "optimal_dtype", "write_index", "data_file_path", "index_file_path"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}


class DataError(ValueError):
    """A training-data problem the user must fix: the message names the file and the cause."""


class IndexedDatasetError(DataError):
    """A ``.bin``/``.idx`` pair is missing, truncated or not in the expected format."""


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, t in DTYPES.items():
        if np.dtype(t) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no indexed-dataset code")


def optimal_dtype(vocab_size: int | None):
    """uint16 if every id fits comfortably (vocab < 65500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def write_index(path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write a ``.idx`` file for sequences of the given lengths (pointers are derived)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Stream sequences into ``bin_path``; ``finalize(idx_path)`` writes the index.

    ``add_item(tokens)`` appends one sequence; ``end_document()`` closes the current document
    (Megatron semantics). ``add_document(tokens)`` does both for a one-sequence document.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"token id outside {self.dtype} range")
        self._file.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        self.add_item(tokens)
        self.end_document()

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        write_index(idx_path, self.dtype, self._lengths, self._doc_idx)

    def close(self) -> None:
        """Close the .bin without writing an index (used on failure)."""
        if not self._file.closed:
            self._file.close()


class IndexedDataset:
    """Read-only view of ``{path_prefix}.bin/.idx`` backed by ``numpy.memmap``.

    ``len(ds)`` is the number of sequences; ``ds[i]`` is sequence i as a numpy array (a view of
    the memmap; negative i allowed); ``ds[a:b]`` a list of such arrays; ``ds.get(i, offset,
    length)`` a slice within sequence i. ``sequence_lengths`` (int32), ``sequence_pointers``
    (int64, bytes) and ``document_indices`` (int64) are the index arrays.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: no such file")
        self._read_index(idx_path)
        self._open_data(bin_path)

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if head[:len(MAGIC)] != MAGIC[:len(head)]:
            raise IndexedDatasetError(f"{path}: wrong magic {head[:len(MAGIC)]!r}, expected "
                                      f"{MAGIC!r} (not a Megatron indexed-dataset index)")
        if len(head) < HEADER_SIZE:
            raise IndexedDatasetError(f"{path}: truncated: {size} bytes, header needs "
                                      f"{HEADER_SIZE}")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unknown version {version}, expected {VERSION}")
        (code,) = struct.unpack_from("<B", head, 17)
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise IndexedDatasetError(
                f"{path}: {what}: {size} bytes, but {n_seq} sequences and {n_doc} document "
                f"indices need {expected}")
        mm = np.memmap(path, mode="r", dtype=np.uint8) if size else None
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(mm, "<i4", n_seq, off) if n_seq else \
            np.zeros(0, np.int32)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, "<i8", n_seq, off) if n_seq else \
            np.zeros(0, np.int64)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, "<i8", n_doc, off) if n_doc else \
            np.zeros(0, np.int64)
        docs = self.document_indices
        if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{path}: document indices must rise from 0 to {n_seq}")
        if n_seq and (self.sequence_lengths.min() < 0):
            raise IndexedDatasetError(f"{path}: negative sequence length")

    def _open_data(self, path: str) -> None:
        itemsize = self.dtype.itemsize
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        need = self.num_tokens * itemsize
        if len(self.sequence_lengths):
            last = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            if last != need or self.sequence_pointers[0] != 0:
                fits = [k for k in (1, 2, 4, 8) if int(self.sequence_pointers[-1]) + int(
                    self.sequence_lengths[-1]) * k == self.num_tokens * k]
                hint = (f" (they fit {fits[0]}-byte tokens, not {itemsize}-byte {self.dtype}: a changed dtype code?)"
                        if fits else "")
                raise IndexedDatasetError(f"{index_file_path(self.path_prefix)}: sequence "
                                          f"pointers disagree with sequence lengths{hint}")
        size = os.path.getsize(path)
        if size != need:
            what = "truncated" if size < need else "has trailing bytes"
            other = [np.dtype(t).name for t in DTYPES.values() if self.num_tokens * np.dtype(t).itemsize == size]
            hint = f" (the .bin holds exactly that many {other[0]} tokens: was the .idx written for another dtype?)" \
                if other and size else ""
            raise IndexedDatasetError(f"{path}: {what}: {size} bytes, but the index describes "
                                      f"{self.num_tokens} tokens of {self.dtype} = {need} bytes{hint}")
        self._tokens = (np.memmap(path, mode="r", dtype=self.dtype.newbyteorder("<"))
                        if size else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def tokens_of(self, first: int, last: int) -> np.ndarray:
        """The tokens of sequences ``[first, last)`` as one memory-mapped view (nothing read yet)."""
        if last <= first:
            return self._tokens[:0]
        a = int(self.sequence_pointers[first]) // self.dtype.itemsize
        b = int(self.sequence_pointers[last - 1]) // self.dtype.itemsize + int(self.sequence_lengths[last - 1])
        return self._tokens[a:b]

    def sequence_at(self, token: int) -> int:
        """The sequence holding flat token position ``token``."""
        return int(np.searchsorted(self.sequence_pointers // self.dtype.itemsize, token, side="right")) - 1

    def document_of(self, sequence: int) -> int:
        """The document holding sequence ``sequence`` (from ``document_indices``)."""
        return int(np.searchsorted(self.document_indices, sequence, side="right")) - 1

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence i (to its end if length is None)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} "
                             f"of length {seq_len}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return np.asarray(self._tokens[start:start + length])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
                f"documents={self.num_documents}, tokens={self.num_tokens}, dtype={self.dtype})")

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return (os.path.isfile(index_file_path(path_prefix))
                and os.path.isfile(data_file_path(path_prefix)))
