"""Write a ``torch.save`` file of ``{name: tensor}`` one tensor at a time, holding one in memory.

``torch.save``'s format is a zip of ``data.pkl`` (the pickled dict; each tensor names its storage
record), then one ``data/K`` record per storage, 64-byte aligned, stored uncompressed. The
layout depends only on names, dtypes and shapes, so it is written first:

1. the skeleton: ``torch.save`` of ``{name: torch.empty(shape, dtype)}`` under
   ``torch.serialization.skip_data()`` (records sized and placed, their bytes not written; the
   ``empty`` tensors are never touched, so they take address space, not memory);
2. the bytes: the file loaded back with ``mmap=True`` and ``MAP_SHARED`` (writes go to the file),
   and each tensor, as it is produced, copied into its place and freed;
3. the checksums: each data record's CRC-32 computed from the file and written into its local
   header and its central-directory entry (``skip_data`` leaves 0 there; ``torch.load`` does not
   check them, zip tools do), so the file is a regular ``torch.save`` zip.

Written under ``PATH.partial`` and renamed when complete; loads with ``weights_only=True``.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib

import torch

_LOCAL_CRC = 14  # offset of the CRC-32 in a local file header ("PK\x03\x04")
_CENTRAL_CRC = 16  # ... in a central-directory entry ("PK\x01\x02")


def save_streamed(path: str, specs: list[tuple[str, torch.Size, torch.dtype]], tensors) -> None:
    """Write ``{name: tensor}`` to ``path``: ``specs`` lists ``(name, shape, dtype)`` in order;
    ``tensors`` yields ``(name, tensor)`` in the same order (each must match its spec)."""
    partial = path + ".partial"
    try:
        skeleton = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in specs}
        with open(partial, "wb") as fh, torch.serialization.skip_data():
            torch.save(skeleton, fh)
        del skeleton
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(partial, mmap=True, weights_only=True)
        produced = iter(tensors)
        for name, shape, dtype in specs:  # (no zip: its reused result tuple would hold the last tensor)
            got, tensor = next(produced, (None, None))
            if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{path}: expected {name} {tuple(shape)} {dtype} next, got {got} "
                                 f"{None if tensor is None else (tuple(tensor.shape), tensor.dtype)}")
            mapped.pop(name).copy_(tensor)
            del tensor  # before the next one is produced
        if next(produced, None) is not None:
            raise ValueError(f"{path}: more tensors than the {len(specs)} specified")
        del mapped
        _fix_checksums(partial)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def _fix_checksums(path: str) -> None:
    """Each record's CRC-32 from its bytes, into both of its headers (read in 16 MiB pieces)."""
    with zipfile.ZipFile(path) as z:
        infos, start = z.infolist(), z.start_dir
    with open(path, "r+b") as fh:
        central = start
        for info in infos:
            fh.seek(info.header_offset)
            local = fh.read(30)
            data = info.header_offset + 30 + struct.unpack("<H", local[26:28])[0] + struct.unpack("<H", local[28:30])[0]
            crc, left = 0, info.file_size
            fh.seek(data)
            while left:
                piece = fh.read(min(left, 16 << 20))
                crc, left = zlib.crc32(piece, crc), left - len(piece)
            fh.seek(central)
            entry = fh.read(46)
            if entry[:4] != b"PK\x01\x02":
                raise ValueError(f"{path}: unexpected zip layout at byte {central}")
            for offset in (info.header_offset + _LOCAL_CRC, central + _CENTRAL_CRC):
                fh.seek(offset)
                fh.write(struct.pack("<I", crc))
            central += 46 + sum(struct.unpack("<HHH", entry[28:34]))
