"""The ``pretrain_gpt.py`` model flags (Megatron-LM's names) that build a given :class:`GPTConfig`:
printed by ``tools/convert_checkpoint.py`` after an import so the user trains the model they
imported (the inverse of the flag parsing in ``megazero.config``)."""

from __future__ import annotations

from megazero.checkpoint.convert.hf_deepseek import mla_mtp_flags
from megazero.checkpoint.convert.megatron_moe import moe_flags


def pretrain_flags(config, tokenizer: dict | None = None) -> str:
    """The model flags (and recorded tokenizer) to train an imported checkpoint with; the
    dropouts are the source's (an HF config's ``attn_pdrop``/``resid_pdrop`` or
    ``attention_dropout``, a Megatron run's ``args``), not Megatron's 0.1 defaults."""
    c = config
    flags = [f"--num-layers {c.num_layers}", f"--hidden-size {c.hidden_size}",
             f"--num-attention-heads {c.num_attention_heads}", f"--ffn-hidden-size {c.ffn_hidden_size}",
             f"--max-position-embeddings {c.max_position_embeddings}", f"--vocab-size {c.vocab_size}",
             f"--position-embedding-type {c.position_embedding_type}", f"--normalization {c.normalization}",
             f"--norm-epsilon {c.norm_epsilon}", f"--attention-dropout {c.attention_dropout:g}",
             f"--hidden-dropout {c.hidden_dropout:g}"]
    if c.num_query_groups != c.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {c.num_query_groups}")
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        flags.append(f"--kv-channels {c.kv_channels}")
    if c.position_embedding_type == "rope":
        flags.append(f"--rotary-base {int(c.rotary_base)}")
    flags += [f for f, on in (("--swiglu", c.activation == "swiglu"), ("--openai-gelu", c.activation == "gelu_tanh"),
                              ("--disable-bias-linear", not c.add_bias_linear),
                              ("--add-qkv-bias", c.add_qkv_bias and not c.add_bias_linear),
                              ("--apply-layernorm-1p", c.apply_layernorm_1p), ("--qk-layernorm", c.qk_layernorm),
                              ("--untie-embeddings-and-output-weights", c.untie_embeddings_and_output_weights)) if on]
    if c.window_size is not None:  # Megatron's tuple: HF's sliding_window W is (W - 1, 0)
        flags.append(f"--window-size {c.window_size[0]},{c.window_size[1]}")
    if c.moe is not None:  # Megatron's MoE flags
        flags += moe_flags(c.moe)
    flags += mla_mtp_flags(c)  # DeepSeek-V3's: Megatron's MLA and MTP flags
    if tokenizer:
        flags.append(f"(tokenizer recorded: {tokenizer['tokenizer_type']})")
    return " ".join(flags)
