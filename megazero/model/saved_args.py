"""A checkpoint's recorded model arguments against the run's: what must agree, and what
``--use-checkpoint-args`` takes from the checkpoint.

* :data:`MODEL_KEYS`: every argument that changes what the weights compute, not only their
  shapes (:data:`~megazero.model.config.SHAPE_KEYS`): the activation (``openai_gelu``: tanh GELU,
  ``swiglu``), the normalization and its epsilon and ``apply_layernorm_1p``, the positions and the
  rotary base, the biases (``add_bias_linear``, ``add_qkv_bias``), the tying of the output layer,
  the query groups (GQA), the MoE router's choices, and multi-latent attention's sizes (shape keys)
  and RoPE (``rope_type``, YaRN's factor, mscales, original length and betas). A load compares them
  (:func:`model_arg_diffs`) and refuses any difference: a flag left at its default that the
  checkpoint recorded otherwise (an imported GPT-2 without ``--openai-gelu``) would otherwise
  train another function silently.
* :data:`CHECKPOINT_ARGS_IF_UNSET` / :data:`CHECKPOINT_ARGS_FORCED`: Megatron-LM's
  ``load_args_from_checkpoint`` (megatron/training/checkpointing.py, core_v0.16.0): its ``_set_arg``
  takes the first list from the checkpoint only where the command line left the value None, the
  second always (``force=True``). megazero has no ``squared_relu``, ``rotary_percent``,
  ``spec``, Mamba or hybrid arguments, so they are not listed; it adds the model arguments its
  checkpoints record and Megatron's list lacks (``openai_gelu``, ``norm_epsilon``), since the
  load refuses a difference in them.
* ``add_qkv_bias`` is recorded as the QKV layer has it (``add_bias_linear or add_qkv_bias``),
  as Megatron-LM's ``validate_args`` sets it under ``add_bias_linear`` before saving
  (megatron/training/arguments.py, core_v0.16.0: "Keep the 'add bias' args in sync"). Where
  ``add_bias_linear`` differs, that line alone is shown (the QKV bias follows from it).
"""

from __future__ import annotations

from .config import SHAPE_KEYS

MODEL_KEYS = SHAPE_KEYS + ("openai_gelu", "rotary_base", "norm_epsilon", "apply_layernorm_1p", "moe_router_topk",
                           "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                           "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
                           "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                           "original_max_position_embeddings", "beta_fast", "beta_slow")

CHECKPOINT_ARGS_IF_UNSET = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                            "kv_channels", "max_position_embeddings")
CHECKPOINT_ARGS_FORCED = ("num_query_groups", "group_query_attention", "position_embedding_type",
                          "rotary_base", "add_bias_linear", "add_qkv_bias", "swiglu",
                          "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
                          "attention_dropout", "hidden_dropout", "num_experts", "moe_layer_freq",
                          "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_grouped_gemm",
                          "moe_shared_expert_intermediate_size", "moe_router_score_function",
                          "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "openai_gelu",
                          "norm_epsilon")

# Arguments whose flag is not ``--`` + the name with dashes (values are shown as the name's).
_FLAG_NAMES = {"add_bias_linear": "--disable-bias-linear (add_bias_linear)",
               "num_query_groups": "--num-query-groups (--group-query-attention)",
               "moe_layer_freq": "--moe-layer-freq (as a per-layer pattern)"}


def flag_name(key: str) -> str:
    """The command-line flag that sets argument ``key``."""
    return _FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def model_arg_diffs(saved: dict, now: dict) -> list[str]:
    """``"FLAG: command line X, checkpoint Y"`` for every :data:`MODEL_KEYS` argument recorded in
    both and different (``max_position_embeddings`` is skipped with rotary positions: no weight
    depends on it; ``add_qkv_bias`` where ``add_bias_linear`` differs, which implies it). Numbers
    compare by value (``10000`` equals ``10000.0``)."""
    skip = {"max_position_embeddings"} if saved.get("position_embedding_type") == "rope" else set()
    if saved.get("add_bias_linear", now.get("add_bias_linear")) != now.get("add_bias_linear"):
        skip.add("add_qkv_bias")
    keys = tuple(k for k in MODEL_KEYS if k not in skip)
    return [f"{flag_name(k)}: command line {now[k]}, checkpoint {saved[k]}"
            for k in keys if k in saved and k in now and saved[k] != now[k]]


def checkpoint_model_args(saved: dict, given: dict) -> dict:
    """The values ``--use-checkpoint-args`` sets: each forced argument the checkpoint recorded
    (not None), and each if-unset one the command line left None (``given``: the flags' values).
    GQA: the recorded switch, or (an import records none) on when the group count differs from
    the head count; the group count only with it (megazero refuses a count without the switch)."""
    out = {k: saved[k] for k in CHECKPOINT_ARGS_FORCED if saved.get(k) is not None and k in given}
    out.update({k: saved[k] for k in CHECKPOINT_ARGS_IF_UNSET
                if saved.get(k) is not None and given.get(k, 0) is None})
    if "group_query_attention" in given:  # megazero records the group count even without GQA (= heads)
        gqa = saved.get("group_query_attention")
        if gqa is None:  # an import records the model's arguments only
            gqa = saved.get("num_query_groups") not in (None, saved.get("num_attention_heads"))
        out["group_query_attention"] = bool(gqa)
        out["num_query_groups"] = saved.get("num_query_groups") if gqa else None
    return out
