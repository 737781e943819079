"""Hugging Face Qwen3 / Qwen3-MoE / Mistral and the sliding windows of Qwen2 and Mixtral <->
megazero (the attention half of :mod:`.hf`; ``transformers`` not needed).

What transformers 5.24 computes (``models/qwen3/modeling_qwen3.py``, ``qwen3_moe``, ``mistral``,
``qwen2``, ``mixtral``; masks in ``masking_utils.py``):

* **QK normalization** (Qwen3, Qwen3-MoE): ``q_norm`` / ``k_norm`` are RMSNorms over ``head_dim``
  (eps ``rms_norm_eps``), one weight for all heads, applied to each head's query and key before
  RoPE: Megatron-LM's ``--qk-layernorm`` with ``--normalization RMSNorm``
  (:class:`megazero.model.attention.HeadNorm`). ``self_attn.q_norm.weight`` maps to
  ``attention.q_norm.weight`` (likewise ``k``), replicated over TP.
* **Sliding window**: ``sliding_window_overlay`` keeps key ``j`` for query ``i`` iff
  ``j > i - W`` (with the causal ``j <= i``): ``W`` keys including itself, Megatron-LM's
  ``--window-size (W - 1, 0)`` (its ``get_sliding_window_causal_mask``: ``i - left <= j <= i``).
  Mistral and Mixtral apply ``sliding_window`` to every layer (None: none). Qwen2 and Qwen3 apply
  it only with ``use_sliding_window`` true, and only to the layers ``layer_types`` marks
  ``sliding_attention`` (by default those ``>= max_window_layers``); megazero has one window for
  every layer, so a config whose layers mix full and sliding attention is refused naming the keys.
  Qwen3-MoE applies ``sliding_window`` to every layer when ``use_sliding_window`` is true.
* Qwen3 is Llama's layout otherwise (no biases: ``attention_bias`` true is refused by :mod:`.hf`'s
  bias check), Qwen3-MoE Qwen2-MoE's without the shared expert (:mod:`.hf_moe`).

Export writes the same keys back (``max_window_layers 0``: every layer sliding), refusing what
an architecture cannot hold (QK-norm outside Qwen3, a window in Llama or GPT-2, biases in
Mistral or Qwen3).
"""

from __future__ import annotations

FAMILY_ARCHS = {"qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
# architectures whose HF config can hold one sliding window for every layer
WINDOW_ARCHS = ("mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
_NAMES = {"qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
          **FAMILY_ARCHS}


def hf_window(c: dict, arch: str, num_layers: int) -> int | None:
    """The HF config dict's sliding window ``W`` for every layer (None: none), refusing a config
    whose layers mix full and sliding attention (module doc)."""
    if arch in ("mistral", "mixtral"):
        return c.get("sliding_window")
    if arch not in ("qwen2", "qwen3", "qwen3_moe") or not c.get("use_sliding_window") \
            or c.get("sliding_window") is None:
        return None
    window = c["sliding_window"]
    if arch == "qwen3_moe":
        return window
    start = c.get("max_window_layers", 28)
    types = c.get("layer_types") or ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if len(set(types)) > 1:
        how = "layer_types" if c.get("layer_types") else f"max_window_layers={start}"
        raise ValueError(f"{_NAMES[arch]} config use_sliding_window=true with {how}: layers mix full and "
                         f"sliding-window attention, megazero has one window for every layer (--window-size)")
    return window if types and types[0] == "sliding_attention" else None


def attention_fields(c: dict, arch: str, num_layers: int) -> dict:
    """The :class:`GPTConfig` fields of an HF config dict's attention extras: ``qk_layernorm``
    (Qwen3, Qwen3-MoE) and ``window_size = (W - 1, 0)`` for a sliding window ``W``."""
    window = hf_window(c, arch, num_layers)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{_NAMES.get(arch, arch)} config sliding_window={window!r}: expected a positive integer")
    return {"qk_layernorm": arch in QK_NORM_ARCHS, "window_size": None if window is None else (window - 1, 0)}


def export_problems(config, arch: str) -> list[str]:
    """What ``arch``'s HF config cannot express of a :class:`GPTConfig`'s attention extras."""
    if getattr(config, "multi_latent_attention", False):
        return ["standard attention (a multi-latent-attention model is not a GPT-2/Llama/Qwen/Mistral one)"]
    bad = []
    if config.qk_layernorm != (arch in QK_NORM_ARCHS):
        bad.append("--qk-layernorm (export as qwen3 / qwen3_moe)" if arch not in QK_NORM_ARCHS else
                   "--qk-layernorm (Qwen3's q_norm / k_norm)")
    if config.qk_layernorm and config.normalization != "RMSNorm":
        bad.append("RMSNorm q/k norms")
    if config.window_size is not None and arch not in WINDOW_ARCHS:
        bad.append(f"no --window-size (export as {' / '.join(WINDOW_ARCHS)})")
    return bad


def window_keys(config, arch: str) -> dict:
    """The HF config keys of the model's window (``W = left + 1``) for ``arch``."""
    W = None if config.window_size is None else config.window_size[0] + 1
    if arch in ("mistral", "mixtral"):
        return {"sliding_window": W}
    out = {"use_sliding_window": W is not None, "sliding_window": W}
    if arch in ("qwen2", "qwen3"):
        out.update(max_window_layers=0 if W is not None else config.num_layers,
                   layer_types=["sliding_attention" if W is not None else "full_attention"] * config.num_layers)
    return out


def family_config(config, arch: str, llama: dict) -> dict:
    """The ``config.json`` of a dense Qwen3 or Mistral :class:`GPTConfig` from its Llama-style part
    (RoPE, RMSNorm, SwiGLU already checked), refusing biases these architectures lack."""
    if config.qkv_bias:
        raise ValueError(f"{FAMILY_ARCHS[arch]} export needs: no biases (--disable-bias-linear, no --add-qkv-bias)")
    dropped = ("mlp_bias", "attention_bias") if arch == "mistral" else ("mlp_bias",)  # Qwen3 has attention_bias
    out = {k: v for k, v in llama.items() if k not in dropped}
    out.update(architectures=[FAMILY_ARCHS[arch]], model_type=arch, **window_keys(config, arch))
    return out
