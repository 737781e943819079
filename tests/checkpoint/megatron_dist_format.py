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
import re

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


MOE_KEYS = {"mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.expert_bias",
            "mlp.shared_expert.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_expert.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
            "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight"}


def dist_key(name: str) -> tuple[str, int | None, int | None]:
    """(Megatron key after ``decoder.layers.[N.]``, layer, routed expert) of a megazero name;
    (the whole key, None, None) outside the layers."""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name], None, None
    if name.startswith("final_norm."):
        return "decoder.final_layernorm." + name.split(".", 1)[1], None, None
    _, layer, rest = name.split(".", 2)
    expert = re.match(r"^mlp\.experts\.(\d+)\.(fc[12])\.weight$", rest)
    if expert:
        return f"mlp.experts.experts.linear_{expert.group(2)}.weight", int(layer), int(expert.group(1))
    if rest in MOE_KEYS:
        return MOE_KEYS[rest], int(layer), None
    module, kind = rest.rsplit(".", 1)
    key = LAYER_KEYS[module]
    if key.endswith(".layer_norm"):
        key, kind = key[:-len(".layer_norm")], "layer_norm_" + kind
    return f"{key}.{kind}", int(layer), None


def _stack(pieces: dict) -> torch.Tensor:
    """One tensor of ``{index tuple: tensor}`` (a leading axis per index position; () alone: itself)."""
    if () in pieces:
        return pieces[()]
    heads = sorted({i[0] for i in pieces})
    return torch.stack([_stack({i[1:]: t for i, t in pieces.items() if i[0] == h}) for h in heads])


def write_torch_dist_checkpoint(root: str, full: dict, config, iteration: int = 7, tp: int = 2,
                                optimizer: bool = False, **extra) -> str:
    """``root`` holding the torch_dist checkpoint of megazero full tensors ``full`` (args say TP
    ``tp``); ``optimizer``: with Adam moments under ``optimizer.state.*`` (the non-distributed
    optimizer's ShardedTensors), a distributed optimizer's ``optimizer.distributed.*`` bytes
    and the ``rng_state`` objects, as a run without ``--no-save-optim`` writes them."""
    c = config
    multiple = c.make_vocab_size_divisible_by * tp
    padded = -(-c.vocab_size // multiple) * multiple
    homogeneous = c.moe is None or all(c.moe.layer_pattern)  # else decoder.layers.N.* keys
    parts: dict[str, dict] = {}
    state = {}
    for name, tensor in full.items():
        if name == "output_layer.weight" and c.tied_embeddings:
            continue
        key, layer, expert = dist_key(name)
        value = megatron_layout(name, tensor, c, padded)
        if layer is None:
            state[key] = value
            continue
        key = f"decoder.layers.{key}" if homogeneous else f"decoder.layers.{layer}.{key}"
        index = (layer,) * homogeneous + (() if expert is None else (expert,))
        parts.setdefault(key, {})[index] = value
    for key, pieces in parts.items():
        state[key] = _stack(pieces)
    state[f"decoder.layers.mlp.linear_fc2._extra_state/shard_0_{c.num_layers}"] = io.BytesIO(b"")
    if optimizer:
        state.update({f"optimizer.state.{kind}.{k}": torch.randn(v.shape) for k, v in list(state.items())
                      if isinstance(v, torch.Tensor) for kind in ("exp_avg", "exp_avg_sq")})
        state["optimizer.distributed.dp_group_idx_0.gbuf_idx_0/shard_0_1"] = io.BytesIO(b"param state")
        state["rng_state/shard_0.0_1.1"] = io.BytesIO(b"rng")
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
