"""Write a Megatron-LM legacy (``--ckpt-format torch``) checkpoint of a megazero model, for tests.

Writes what NVIDIA/Megatron-LM (tags core_v0.13.0, core_v0.16.1) writes: ``latest_checkpointed_iteration.txt``
(iteration or ``release``), ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``
(an ``argparse.Namespace`` with Megatron's names), ``checkpoint_version`` 3.0, ``iteration``,
``model`` / ``model0..`` (one per virtual stage), ``optimizer``, ``opt_param_scheduler``,
``rng_state``, ``rerun_state_machine`` (megatron/training/checkpointing.py: generate_state_dict,
get_checkpoint_name). Model keys, per family:

* ``legacy``: nested dicts of megatron/legacy/model (gpt_model.py, language_model.py,
  transformer.py): ``language_model.embedding.word_embeddings.weight``,
  ``language_model.encoder.layers.i.self_attention.query_key_value.weight``, ...,
  ``language_model.encoder.final_norm.*``, ``language_model.output_layer.weight`` (untied),
  ``word_embeddings_for_head.weight`` (tied, last stage with PP > 1);
* ``mcore``: flat keys of megatron/core/models/gpt (local spec): ``decoder.layers.i.input_layernorm``,
  ``self_attention.linear_qkv``, ``self_attention.linear_proj``, ``pre_mlp_layernorm``,
  ``mlp.linear_fc1``, ``mlp.linear_fc2``, ``decoder.final_layernorm``, ``output_layer.weight``;
* ``te``: mcore with Transformer Engine's fused norms (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``) and ``_extra_state`` entries.

Layers are numbered within each chunk; QKV rows per query group ``[q heads, k, v]``; SwiGLU fc1
per TP rank ``[gate_t; up_t]``; the vocabulary padded to ``padded_vocab_size`` with random rows.

MoE (mcore families, core 0.20.0's megatron/core/transformer/moe/): ``mlp.router.weight`` and
``expert_bias``, ``mlp.shared_experts.linear_fc1/linear_fc2.weight`` and ``gate_weight``, and the
routed experts of the file's EP rank (local numbers) split over expert TP, as ``experts`` says:
``sequential`` (``local_experts.k.linear_fc1.weight``), ``grouped`` (TEGroupedMLP's
``linear_fc1.weight{k}``) or ``legacy`` (GroupedMLP's ``weight1`` ``[h, E_local F]`` holding the
``[E_local, h, F]`` transposed pieces, ``weight2`` ``[E_local f, h]``); a TE MoE layer keeps its
own ``pre_mlp_layernorm``. Files are those Megatron's legacy save writes: one per (TP, PP, EP)
rank triple of a rank with DP rank 0 or expert-DP rank 0, ``mp_rank_TT[_PPP][_EEE]``.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal

import numpy as np

import torch

LEGACY = {"input_norm": "input_norm", "attention.qkv": "self_attention.query_key_value",
          "attention.dense": "self_attention.dense", "post_attention_norm": "post_attention_norm",
          "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}
MCORE = {"input_norm": "input_layernorm", "attention.qkv": "self_attention.linear_qkv",
         "attention.dense": "self_attention.linear_proj", "post_attention_norm": "pre_mlp_layernorm",
         "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}


def megatron_args(config, tp: int, pp: int, vp: int | None, padded: int, family: str = "legacy",
                  **extra) -> argparse.Namespace:
    """Megatron's ``args`` for ``config``; the activation as each family's model reads it (legacy:
    ``openai_gelu``; mcore: the tanh gelu of the default ``bias_gelu_fusion``, exact gelu without),
    ``exit_signal`` a ``signal.Signals`` as Megatron-LM 0.16 stores it; ``extra`` overrides."""
    c = config
    tanh = c.activation == "gelu_tanh"
    if family != "legacy":
        if tanh and not c.add_bias_linear:
            raise ValueError("an mcore model without biases computes exact gelu (no fused bias-gelu)")
        extra = {"bias_gelu_fusion": tanh and c.add_bias_linear, **extra}
    if c.moe is not None:
        extra = {**c.moe.to_args(), "moe_layer_freq": list(c.moe.layer_pattern), **extra}
    return argparse.Namespace(**{**dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, kv_channels=c.kv_channels,
        group_query_attention=c.num_query_groups != c.num_attention_heads, num_query_groups=c.num_query_groups,
        seq_length=c.seq_length, max_position_embeddings=c.max_position_embeddings,
        position_embedding_type=c.position_embedding_type, rotary_base=int(c.rotary_base), rotary_percent=1.0,
        normalization=c.normalization, norm_epsilon=c.norm_epsilon, swiglu=c.activation == "swiglu",
        openai_gelu=tanh and family == "legacy", add_bias_linear=c.add_bias_linear,
        add_qkv_bias=c.add_bias_linear or c.add_qkv_bias,  # validate_args: on under add_bias_linear
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights, padded_vocab_size=padded,
        make_vocab_size_divisible_by=c.make_vocab_size_divisible_by, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp, params_dtype=torch.float32,
        init_method_std=c.init_method_std, seed=c.seed, attention_dropout=0.0, hidden_dropout=0.0,
        ckpt_format="torch", no_save_optim=False, exit_signal=signal.SIGTERM), **extra})


def _shard(name: str, full: torch.Tensor, config, tp: int, padded: int) -> list[torch.Tensor]:
    """This megazero full tensor as Megatron's ``tp`` shards (a routed expert's: expert TP)."""
    c = config
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    suffix = re.sub(r"^mlp\.(experts\.\d+|shared_expert)\.", "mlp.", suffix)
    if suffix in ("embedding.word_embeddings.weight", "output_layer.weight"):
        pad = torch.randn(padded - full.shape[0], *full.shape[1:], generator=torch.Generator().manual_seed(1))
        return list(torch.cat([full, pad]).chunk(tp, 0))
    if suffix in ("attention.dense.weight", "mlp.fc2.weight"):
        return list(full.chunk(tp, 1))
    if suffix.startswith("attention.qkv."):
        q_rows = c.num_attention_heads * c.kv_channels
        q, k, v = full.split([q_rows, c.num_query_groups * c.kv_channels, c.num_query_groups * c.kv_channels])
        g = c.num_query_groups
        fused = torch.cat([q.reshape(g, -1, *full.shape[1:]), k.reshape(g, -1, *full.shape[1:]),
                           v.reshape(g, -1, *full.shape[1:])], 1).reshape(full.shape)
        return list(fused.chunk(tp, 0))
    if suffix.startswith("mlp.fc1.") and c.activation == "swiglu":
        gate, up = full.chunk(2, 0)
        return [torch.cat([a, b]) for a, b in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    if suffix.startswith("mlp.fc1."):
        return list(full.chunk(tp, 0))
    return [full.clone() for _ in range(tp)]


MOE_KEYS = {"mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.expert_bias",
            "mlp.shared_expert.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_expert.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
            "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight"}


def _key(name: str, local: int | None, family: str, moe_layer: bool = False) -> str:
    """The flat Megatron key of a megazero name (layer ``local`` within its chunk)."""
    if name.startswith("layers."):
        _, _, rest = name.split(".", 2)
        if rest in MOE_KEYS:
            return f"decoder.layers.{local}.{MOE_KEYS[rest]}"
        module, kind = rest.rsplit(".", 1)
        if family == "te" and module in ("input_norm", "post_attention_norm") and not (
                moe_layer and module == "post_attention_norm"):
            fused = "self_attention.linear_qkv" if module == "input_norm" else "mlp.linear_fc1"
            return f"decoder.layers.{local}.{fused}.layer_norm_{kind}"
        if family == "legacy":
            return f"language_model.encoder.layers.{local}.{LEGACY[module]}.{kind}"
        return f"decoder.layers.{local}.{MCORE[module]}.{kind}"
    if name.startswith("final_norm."):
        return ("language_model.encoder.final_norm." if family == "legacy" else "decoder.final_layernorm.") + \
            name.split(".", 1)[1]
    if family == "legacy":
        return {"output_layer.weight": "language_model.output_layer.weight"}.get(name, "language_model." + name)
    return name


def _nest(flat: dict) -> dict:
    """Legacy nesting: language_model -> embedding -> word_embeddings -> weight; encoder flat."""
    out: dict = {}
    for key, t in flat.items():
        if key.startswith("language_model.encoder."):
            out.setdefault("language_model", {}).setdefault("encoder", {})[key[len("language_model.encoder."):]] = t
        else:
            node = out
            *path, leaf = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = t
    return out


def _experts(full: dict, config, layer: int, local: int, e: int, ep: int, et: int, etp: int, layout: str) -> dict:
    """The flat keys of layer ``layer``'s routed experts held by EP rank ``e``, expert-TP piece ``et``."""
    per, prefix = config.moe.num_experts // ep, f"decoder.layers.{local}.mlp.experts."
    pieces = {fc: [_shard(f"layers.{layer}.mlp.experts.{e * per + k}.{fc}.weight",
                          full[f"layers.{layer}.mlp.experts.{e * per + k}.{fc}.weight"], config, etp, 0)[et]
                   for k in range(per)] for fc in ("fc1", "fc2")}
    if layout == "legacy":  # GroupedMLP: the [E_local, h, F] memory of weight1 [h, E_local F]
        h = config.hidden_size
        return {prefix + "weight1": torch.stack([w.t() for w in pieces["fc1"]]).reshape(h, -1),
                prefix + "weight2": torch.stack([w.t() for w in pieces["fc2"]]).reshape(-1, h)}
    out = {}
    for fc, ws in pieces.items():
        for k, w in enumerate(ws):
            key = f"local_experts.{k}.linear_{fc}.weight" if layout == "sequential" else f"linear_{fc}.weight{k}"
            out[prefix + key] = w.clone()
        if layout == "grouped":
            out[prefix + f"linear_{fc}._extra_state"] = torch.zeros(0, dtype=torch.uint8)
    return out


def _chunk_state(full: dict, config, t, stage, per_chunk, first, last, family, tp, padded, moe=None) -> dict:
    """One model chunk's flat keys; ``moe``: (EP rank, EP, expert-TP rank, expert TP, experts layout)."""
    flat = {}
    for name, tensor in full.items():
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if not stage * per_chunk <= layer < (stage + 1) * per_chunk:
                continue
            moe_layer = config.moe is not None and config.moe.is_moe(layer)
            if ".mlp.experts." in name:
                if name.endswith(".experts.0.fc1.weight"):  # once per layer
                    flat.update(_experts(full, config, layer, layer - stage * per_chunk, *moe))
                continue
            flat[_key(name, layer - stage * per_chunk, family, moe_layer)] = \
                _shard(name, tensor, config, tp, padded)[t]
            if family == "te" and name.endswith("attention.dense.weight"):
                flat[f"decoder.layers.{layer - stage * per_chunk}.self_attention.linear_proj._extra_state"] = \
                    torch.zeros(0, dtype=torch.uint8)
        elif name.startswith("embedding.") and first or (name.startswith(("final_norm.", "output_layer.")) and last):
            flat[_key(name, None, family)] = _shard(name, tensor, config, tp, padded)[t]
    if config.tied_embeddings and last and not first:  # the head's copy of the tied embedding
        head = "word_embeddings_for_head.weight" if family == "legacy" else "output_layer.weight"
        flat[head] = _shard("embedding.word_embeddings.weight", full["embedding.word_embeddings.weight"],
                            config, tp, padded)[t]
    return _nest(flat) if family == "legacy" else flat


def _file_ranks(tp: int, ep: int, etp: int) -> list[tuple[int, int, int]]:
    """(TP rank, EP rank, expert-TP rank) of each file Megatron's legacy save writes per stage:
    ranks with DP rank 0 or expert-DP rank 0 of the smallest DP that fits EP x ETP."""
    dp = next(d for d in range(1, ep * etp + 1) if (tp * d) % (ep * etp) == 0)
    out = set()
    for s in range(tp * dp):
        if s // tp == 0 or s // (etp * ep) == 0:
            out.add((s % tp, (s // etp) % ep, s % etp))
    return sorted(out)


def write_megatron_checkpoint(root: str, full: dict, config, tp: int, pp: int, vp: int | None = None,
                              family: str = "legacy", iteration: int | None = 20, ep: int = 1,
                              etp: int | None = None, experts: str = "sequential", **extra_args) -> str:
    """Write ``full`` (megazero names, unpadded) as Megatron-LM does at TP x PP (x VP) (x EP, with
    expert TP ``etp``, default TP); returns root. ``iteration`` None writes a ``release`` checkpoint."""
    chunks, etp = vp or 1, etp or tp
    per_chunk = config.num_layers // (pp * chunks)
    padded = config.padded_vocab(tp)
    if config.moe is not None:
        extra_args.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                          moe_grouped_gemm=experts != "sequential", moe_use_legacy_grouped_gemm=experts == "legacy")
    args = megatron_args(config, tp, pp, vp, padded, family, **extra_args)
    folder = os.path.join(root, "release" if iteration is None else f"iter_{iteration:07d}")
    for t, e, et in _file_ranks(tp, ep, etp):
        for p in range(pp):
            state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0,
                     "optimizer": {"optimizer": {"state": {}, "param_groups": []}, "fp32_from_fp16_params": []},
                     "opt_param_scheduler": {"num_steps": 160}, "rerun_state_machine": None,
                     "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                    "torch_rng_state": torch.get_rng_state()}]}
            for c in range(chunks):
                stage = c * pp + p
                key = "model" if chunks == 1 else f"model{c}"
                state[key] = _chunk_state(full, config, t, stage, per_chunk, stage == 0, stage == pp * chunks - 1,
                                          family, tp, padded, (e, ep, et, etp, experts))
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
            rank_dir = os.path.join(folder, name)
            os.makedirs(rank_dir, exist_ok=True)
            torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("release" if iteration is None else str(iteration))
    return root
