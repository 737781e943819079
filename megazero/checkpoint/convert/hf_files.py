"""A saved Hugging Face model folder read one tensor at a time (``config.json`` + safetensors or
``pytorch_model.bin``, single or sharded with a ``*.index.json``); ``transformers`` not needed."""

from __future__ import annotations

import json
import os

import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _open_weights(file: str):
    """``(get, names)`` of one weights file; a file that cannot be opened (truncated, empty, not
    that format) is a ValueError naming it."""
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open
            handle = safe_open(file, framework="pt")  # memory-mapped, one tensor per get
            return handle.get_tensor, set(handle.keys())
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # safetensors' own error class, a truncated zip, a bad pickle
        raise ValueError(f"{file} cannot be read ({type(e).__name__}: {e}); is it truncated or damaged? "
                         "download or save it again") from None
    return state.__getitem__, set(state)


def hf_weights(path: str):
    """``(get, names)``: one tensor at a time from a saved HF folder's weights, the first of
    :data:`WEIGHT_FILES` there (safetensors preferred); a ``*.index.json`` names the shard of each
    tensor (``weight_map``), shards opened when first read."""
    found = [os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))]
    if not found:
        raise FileNotFoundError(f"{path}: none of {', '.join(WEIGHT_FILES)}")
    if not found[0].endswith(".json"):
        return _open_weights(found[0])
    with open(found[0]) as fh:
        weight_map = json.load(fh)["weight_map"]
    shards = {}

    def get(name: str) -> torch.Tensor:
        shard = weight_map[name]
        if shard not in shards:
            shards[shard] = _open_weights(os.path.join(path, shard))[0]
        return shards[shard](name)
    return get, set(weight_map)


def read_hf_folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a saved HF model folder (:func:`hf_weights`)."""
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    get, names = hf_weights(path)
    return config, {name: get(name) for name in sorted(names)}
