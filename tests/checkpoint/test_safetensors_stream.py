"""The streaming safetensors writer: its files load with the safetensors library exactly as
``save_file``'s, written one tensor at a time from a header computed on meta tensors; a tensor
out of order, or one never written, is an error and leaves no file."""

import os

import pytest
import torch
from safetensors.torch import load_file

from megazero.checkpoint.safetensors_stream import SafetensorsWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16), "a.bias": torch.randn(7, generator=g),
            "scalar": torch.tensor(2.5, dtype=torch.float16), "ids": torch.arange(4), "empty": torch.zeros(0, 3),
            "mask": torch.tensor([True, False, True])}


def test_streamed_file_loads_as_saved(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "model.safetensors")
    specs = [(k, torch.empty(v.shape, dtype=v.dtype, device="meta")) for k, v in tensors.items()]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in tensors.items())
    assert not os.path.exists(path + ".partial")


def test_out_of_order_or_missing_tensors_leave_no_file(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "model.safetensors")
    specs = [(k, v) for k, v in tensors.items()]
    with pytest.raises(ValueError, match="expected tensor"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a.bias", tensors["a.bias"])
    with pytest.raises(ValueError, match="never written, first 'a.bias'"):
        with SafetensorsWriter(path, specs) as w:
            w.write("b.weight", tensors["b.weight"])
    with pytest.raises(ValueError, match="expected tensor"):  # right name, wrong shape
        with SafetensorsWriter(path, specs) as w:
            w.write("b.weight", tensors["b.weight"].t())
    assert os.listdir(tmp_path) == []
