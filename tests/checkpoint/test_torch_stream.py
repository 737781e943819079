"""megazero/checkpoint/torch_stream.py (``convert_checkpoint.py to-fp32``): a ``torch.save`` file
written one tensor at a time -- the records torch.save writes, valid CRC-32s, loadable with
weights_only=True -- holding no produced tensor after it is written; a wrong tensor leaves no file."""

import io
import os
import weakref
import zipfile

import pytest
import torch

from megazero.checkpoint.torch_stream import save_streamed


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"embedding.weight": torch.randn(100, 32, generator=g), "layers.0.bias": torch.randn(32, generator=g),
            "half": torch.randn(7, 3, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 4)}


def test_streamed_file_is_torch_saves_and_holds_one_tensor(tmp_path):
    ref, path = _tensors(), str(tmp_path / "model_fp32.pt")
    alive = []

    def produce():
        for name, t in ref.items():
            assert all(w() is None for w in alive), "an earlier tensor is still held"
            out = t.clone()
            alive.append(weakref.ref(out))
            yield name, out
            del out

    save_streamed(path, [(n, t.shape, t.dtype) for n, t in ref.items()], produce())
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(ref) and all(torch.equal(loaded[n], ref[n]) for n in ref)
    with zipfile.ZipFile(path) as ours:
        assert ours.testzip() is None  # every CRC-32 right
        buf = io.BytesIO()
        torch.save(ref, buf)
        with zipfile.ZipFile(buf) as theirs:
            assert [i.filename for i in ours.infolist()] == [i.filename for i in theirs.infolist()]
            for a, b in zip(ours.infolist(), theirs.infolist()):
                assert a.header_offset == b.header_offset
                if not a.filename.endswith("serialization_id"):  # an id torch derives while writing
                    assert ours.read(a) == theirs.read(b) and a.CRC == b.CRC, a.filename
    assert not os.path.exists(path + ".partial")


def test_a_wrong_tensor_leaves_no_file(tmp_path):
    ref, path = _tensors(), str(tmp_path / "out.pt")
    bad = ((n, t if n != "layers.0.bias" else t[:5]) for n, t in ref.items())
    with pytest.raises(ValueError, match="expected layers.0.bias"):
        save_streamed(path, [(n, t.shape, t.dtype) for n, t in ref.items()], bad)
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")
