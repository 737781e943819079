"""Hugging Face Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``) and Qwen2-MoE's attention <-> megazero.

What transformers computes (5.24, ``models/qwen2/modeling_qwen2.py``: ``Qwen2Attention``,
``Qwen2MLP``; ``models/qwen2_moe/modeling_qwen2_moe.py``: ``Qwen2MoeAttention``):

* ``q_proj``, ``k_proj``, ``v_proj`` are ``nn.Linear(..., bias=True)`` (Qwen2-MoE:
  ``bias=config.qkv_bias``, a key whose default is true and which configs older than it lack);
  ``o_proj``, the MLP's ``gate_proj``/``up_proj``/``down_proj`` and ``lm_head`` have no bias. So
  ``[q; k; v] = W_qkv x + b_qkv`` and nothing else is biased: Megatron-LM's ``--add-qkv-bias``
  with ``--disable-bias-linear`` (core_v0.16.0, ``megatron/core/transformer/attention.py``:
  ``linear_qkv`` built with ``bias=add_bias_linear or add_qkv_bias``).
* The rest is Llama's: RMSNorm (``rms_norm_eps``), SwiGLU (``hidden_act`` silu), RoPE
  rotate-half with ``rope_theta``, GQA (``num_key_value_heads``), the head tied or not
  (``tie_word_embeddings``, default false; the small Qwen2.5 models tie it). The weights map as
  Llama's (:mod:`.hf`'s table: the ``q/k/v_proj`` biases concatenate into ``attention.qkv.bias``,
  rows ``[Q; K; V]`` as the weight's, split over TP as its rows are).
* Sliding-window attention: Qwen2's (one window for every layer, ``--window-size``) is
  :mod:`.hf_families`'; a config whose layers mix full and sliding attention is refused there.
  Qwen2-MoE's (every other layer below ``max_window_layers``) is refused naming the key.
  transformers leaves it off by default (``use_sliding_window = False``), as every released Qwen2 /
  Qwen2.5 / Qwen1.5-MoE config does.
"""

from __future__ import annotations

from .hf_families import window_keys

QWEN2_ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def qwen2_fields(c: dict, arch: str) -> dict:
    """The :class:`GPTConfig` bias fields of an HF Qwen2 / Qwen2-MoE config dict: no bias but
    the QKV projection's (Qwen2 always; Qwen2-MoE as ``qkv_bias``, default true), refusing
    Qwen2-MoE's sliding windows."""
    types = c.get("layer_types") or []
    if arch == "qwen2_moe" and (c.get("use_sliding_window") or "sliding_attention" in types):
        raise ValueError(f"{QWEN2_ARCHS[arch]} config use_sliding_window={c.get('use_sliding_window')!r}: "
                         "sliding-window attention is not available in megazero (use_sliding_window false, "
                         "every layer full attention, converts)")
    qkv_bias = bool(c.get("qkv_bias", True)) if arch == "qwen2_moe" else True
    return {"add_bias_linear": False, "add_qkv_bias": qkv_bias}


def qwen2_config(config, llama: dict) -> dict:
    """The ``Qwen2ForCausalLM`` ``config.json`` of a dense :class:`GPTConfig` from its Llama-style
    part ``llama`` (RoPE, RMSNorm, SwiGLU already checked), refusing biases Qwen2 lacks or a QKV
    without its bias."""
    bad = [m for m, ok in (("no biases but the QKV's (--disable-bias-linear)", not config.add_bias_linear),
                           ("a QKV bias (--add-qkv-bias)", config.qkv_bias)) if not ok]
    if bad:
        raise ValueError(f"{QWEN2_ARCHS['qwen2']} export needs: {', '.join(bad)}")
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(architectures=[QWEN2_ARCHS["qwen2"]], model_type="qwen2", **window_keys(config, "qwen2"))
    return out
