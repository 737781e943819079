"""Multi-latent attention's fields of :class:`~megazero.model.config.GPTConfig`: names, Megatron's
defaults, what a checkpoint records and what the config refuses.

The names are Megatron-LM's (``MLATransformerConfig``, megatron/core/transformer/transformer_config.py,
core_v0.16.0 .. core_v0.19.0; flags in megatron/training/arguments.py ``_add_mla_args``):
``--multi-latent-attention``, ``--q-lora-rank`` (None: no query compression), ``--kv-lora-rank``
(default 32), ``--qk-head-dim`` (the per-head query/key part without position, 128; Hugging Face's
``qk_nope_head_dim``), ``--qk-pos-emb-head-dim`` (the decoupled RoPE part, 64; HF's
``qk_rope_head_dim``), ``--v-head-dim`` (128), ``--rope-type`` (None: MLA takes ``yarn``, as
Megatron's ``MLATransformerConfig.rope_type``), ``--rotary-scaling-factor`` (1.0; HF's
``rope_scaling.factor``), ``--mscale`` (1.0), ``--mscale-all-dim`` (0.0). YaRN's
``original_max_position_embeddings`` (4096), ``beta_fast`` (32) and ``beta_slow`` (1) have no flag
for MLA in Megatron (core_v0.19.0's ``--yarn-*`` flags are for standard attention and
explicitly do not reach MLA): they are ``MLATransformerConfig``'s defaults here too, settable
through the config (a Hugging Face import) and recorded in checkpoints.
"""

from __future__ import annotations

# name -> default (Megatron's flag defaults; the YaRN three: MLATransformerConfig's)
MLA_DEFAULTS = {"multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
                "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rope_type": None, "rotary_scaling_factor": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0}
MLA_ARG_KEYS = tuple(MLA_DEFAULTS)
# the ones that fix weight shapes (the rest change what the weights compute: saved_args.MODEL_KEYS)
MLA_SHAPE_KEYS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim")
ROPE_TYPES = ("yarn", "rope")


def mla_from_megatron(given: dict) -> dict:
    """GPTConfig keyword arguments from Megatron-named values (absent or None: the default)."""
    out = {k: given[k] for k in MLA_ARG_KEYS if given.get(k) is not None}
    if "multi_latent_attention" in out:
        out["multi_latent_attention"] = bool(out["multi_latent_attention"])
    return out


def mla_to_args(config) -> dict:
    """The MLA fields under Megatron's names (what a checkpoint records); a model without MLA
    records only the switch (off)."""
    if not config.multi_latent_attention:
        return {"multi_latent_attention": False}
    return {k: getattr(config, k) for k in MLA_ARG_KEYS}


def mla_problem(config) -> str | None:
    """The first thing wrong with ``config``'s MLA settings, as one line naming the flag, or None.
    (TP divisibility is :meth:`GPTConfig.check_tp`'s: the heads split as for standard attention.)"""
    if not config.multi_latent_attention:
        if config.rope_type == "yarn":
            return ("--rope-type yarn without --multi-latent-attention: megazero's YaRN is MLA's (standard "
                    "attention takes plain rope)")
        return None
    c = config
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(c, name)}: must be a positive integer with --multi-latent-attention"
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        return f"--q-lora-rank {c.q_lora_rank}: must be a positive integer (or absent: no query compression)"
    if c.qk_pos_emb_head_dim % 2:
        return f"--qk-pos-emb-head-dim {c.qk_pos_emb_head_dim}: RoPE rotates pairs, the size must be even"
    if (c.rope_type or "yarn") not in ROPE_TYPES:
        return f"--rope-type {c.rope_type!r}: MLA takes yarn or rope"
    if c.position_embedding_type != "rope":
        return ("--multi-latent-attention needs --position-embedding-type rope: MLA's positions are its decoupled "
                "RoPE part (megazero adds no learned positions to it)")
    if c.num_query_groups != c.num_attention_heads:
        return ("--multi-latent-attention with --group-query-attention: mutually exclusive (Megatron's rule); "
                "every head expands from the shared latent")
    if getattr(c, "window_size", None) is not None:  # Megatron's --window-size: standard attention's
        return "--window-size with --multi-latent-attention: a sliding window is not available for MLA"
    if c.add_qkv_bias:
        return "--add-qkv-bias with --multi-latent-attention: MLA has no QKV projection (its projections carry no bias)"
    if c.rotary_scaling_factor <= 0 or c.original_max_position_embeddings < 1 or c.beta_fast <= c.beta_slow:
        return (f"YaRN settings rotary_scaling_factor {c.rotary_scaling_factor}, original_max_position_embeddings "
                f"{c.original_max_position_embeddings}, beta_fast {c.beta_fast} > beta_slow {c.beta_slow} are needed")
    return None


def mla_attention_flops_per_token(config) -> float:
    """One MLA layer's FLOPs per token, forward and backward: Megatron-LM core_v0.16.0
    ``num_floating_point_operations`` (megatron/training/training.py), ``3 x 2 x`` the GEMMs'
    multiply-adds -- query (``r_q (h + H d_q + 1)``, or ``h H d_q``), key/value
    (``r_kv (h + H (d_n + d_v) + 1) + h d_r``), output ``H d_v h``, and the causal core attention
    ``s H d_q / 2 + s H d_v / 2`` (the ``+ 1``: the latent norms)."""
    c = config
    h, H, s = c.hidden_size, c.num_attention_heads, c.seq_length
    d_q = c.qk_head_dim + c.qk_pos_emb_head_dim
    q = h * H * d_q if c.q_lora_rank is None else c.q_lora_rank * (h + H * d_q + 1)
    kv = c.kv_lora_rank * (h + H * (c.qk_head_dim + c.v_head_dim) + 1) + h * c.qk_pos_emb_head_dim
    return 6.0 * (q + kv + H * c.v_head_dim * h + s * H * d_q / 2 + s * H * c.v_head_dim / 2)
