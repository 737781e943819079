"""Write a ``.safetensors`` file one tensor at a time, holding one tensor in memory.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
unsigned header length ``n``; ``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`` (padded with spaces to a multiple of 8 bytes);
then the tensors' bytes, row-major, little-endian, each at ``[begin, end)`` of the data part,
one after another without gaps. The header depends only on names, dtypes and shapes, so it is
written first, from meta tensors (``torch.empty(shape, dtype=dtype, device="meta")``); each
tensor's bytes follow as it is produced, in the same order. The file is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import struct

import torch

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


def header_bytes(specs: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> bytes:
    """The length prefix and JSON header of ``specs`` (``(name, tensor)`` in file order; meta
    tensors suffice): tensor ``k`` occupies ``[sum of earlier sizes, + its numel x element size)``."""
    header, offset = {}, 0
    for name, t in specs:
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"safetensors has no dtype for {name!r} ({t.dtype})")
        if name in header or name == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """``with SafetensorsWriter(path, specs, metadata) as w: w.write(name, tensor) ...`` in the
    order of ``specs``; each tensor must match its spec's shape and dtype. Closing without every
    tensor written (or after an error) removes the partial file and raises."""

    def __init__(self, path: str, specs: list[tuple[str, torch.Tensor]], metadata: dict | None = None):
        self.path, self.partial = path, path + ".partial"
        self.expected = [(name, tuple(t.shape), t.dtype) for name, t in specs]
        self.header = header_bytes(specs, metadata)
        self.written = 0
        self.file = None

    def __enter__(self) -> "SafetensorsWriter":
        self.file = open(self.partial, "wb")
        self.file.write(self.header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes (it must be the next expected ``name``, shape and dtype)."""
        if self.written >= len(self.expected):
            raise ValueError(f"{self.path}: {name!r} is one tensor more than the header lists")
        want = self.expected[self.written]
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != want:
            raise ValueError(f"{self.path}: expected tensor {want} next, got {got}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.file.write(memoryview(data.view(torch.uint8).numpy()))
        self.written += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self.file.close()
        if exc_type is None and self.written != len(self.expected):
            missing = [name for name, _, _ in self.expected[self.written:]]
            os.remove(self.partial)
            raise ValueError(f"{self.path}: {len(missing)} tensors never written, first {missing[0]!r}")
        if exc_type is not None:
            os.remove(self.partial)
            return
        os.replace(self.partial, self.path)
