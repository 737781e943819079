"""Write a Megatron-LM ``--ckpt-format torch_dist`` checkpoint of a megazero model, for tests,
without megatron-core: ``torch.distributed.checkpoint.save(no_dist=True)`` of the keys, shapes
and layouts megatron-core 0.16.1 writes (observed in tests/peers/test_megatron_dist_checkpoints.py):

``DIR/latest_checkpointed_iteration.txt``; ``DIR/iter_NNNNNNN/`` with DCP's ``.metadata`` and
``__0_0.distcp``, ``metadata.json`` ``{"sharded_backend": "torch_dist", ...}`` and ``common.pt``
(``args``, ``checkpoint_version`` 3.0, ``iteration``, ``content_metadata``). Layers stacked on a
leading axis (``decoder.layers.self_attention.linear_qkv.weight`` ``[L, rows, h]``), norms under
TE's fused names, QKV rows per query group ``[q heads; k; v]``, SwiGLU fc1 ``[gate; up]``, the
vocabulary padded to ``padded`` rows; ``_extra_state`` as bytes entries, as Megatron writes them.
"""
from __future__ import annotations

import io
import json
import os

import torch
import torch.distributed.checkpoint as dcp

from tests.checkpoint.megatron_format import megatron_args

LAYER_KEYS = {"input_norm": "self_attention.linear_qkv.layer_norm", "attention.qkv": "self_attention.linear_qkv",
              "attention.dense": "self_attention.linear_proj", "post_attention_norm": "mlp.linear_fc1.layer_norm",
              "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
GLOBAL_KEYS = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
               "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
               "output_layer.weight": "output_layer.weight"}


def megatron_layout(name: str, full: torch.Tensor, config, padded: int) -> torch.Tensor:
    """A megazero full tensor in Megatron's global layout (grouped QKV, padded vocabulary)."""
    c = config
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return torch.cat([full, torch.zeros(padded - full.shape[0], *full.shape[1:])])
    if ".attention.qkv." in name:
        g, rest = c.num_query_groups, full.shape[1:]
        q, k, v = full.split([c.num_attention_heads * c.kv_channels, g * c.kv_channels, g * c.kv_channels])
        return torch.cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], 1).reshape(full.shape)
    return full


def dist_key(name: str) -> tuple[str, int | None]:
    """(Megatron key, layer) of a megazero name; layers' keys are the stacked ones."""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name], None
    if name.startswith("final_norm."):
        return "decoder.final_layernorm." + name.split(".", 1)[1], None
    _, layer, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    key = LAYER_KEYS[module]
    if key.endswith(".layer_norm"):
        key, kind = key[:-len(".layer_norm")], "layer_norm_" + kind
    return f"decoder.layers.{key}.{kind}", int(layer)


def write_torch_dist_checkpoint(root: str, full: dict, config, iteration: int = 7, tp: int = 2, **extra) -> str:
    """``root`` holding the torch_dist checkpoint of megazero full tensors ``full`` (args say TP ``tp``)."""
    c = config
    multiple = c.make_vocab_size_divisible_by * tp
    padded = -(-c.vocab_size // multiple) * multiple
    stacked: dict[str, list] = {}
    state = {}
    for name, tensor in full.items():
        if name == "output_layer.weight" and c.tied_embeddings:
            continue
        key, layer = dist_key(name)
        value = megatron_layout(name, tensor, c, padded)
        if layer is None:
            state[key] = value
        else:
            stacked.setdefault(key, [None] * c.num_layers)[layer] = value
    state.update({k: torch.stack(v) for k, v in stacked.items()})
    for module in ("self_attention.linear_qkv", "mlp.linear_fc2"):
        state[f"decoder.layers.{module}._extra_state/shard_0_{c.num_layers}"] = io.BytesIO(b"")
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    args = megatron_args(c, tp, 1, None, padded, family="mcore",
                         **{"ckpt_format": "torch_dist", "tokenizer_type": "NullTokenizer",
                            "vocab_size": c.vocab_size - 1, **extra})
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "content_metadata": {"singleton_local_shards": False}}, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, fh)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    return root
