"""Multi-latent attention's rotary embedding: YaRN (or plain) RoPE on the decoupled part, DeepSeek's
pair layout, and the softmax scale.

YaRN (Peng et al. 2023), as Megatron-LM's ``YarnRotaryEmbedding``
(megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py, core_v0.16.1) and
transformers 5.24.0's ``_compute_yarn_parameters`` compute it, for ``d = qk_pos_emb_head_dim``,
base ``b``, factor ``f = rotary_scaling_factor``, ``L0 = original_max_position_embeddings``::

    extra_i = b^(-2i/d),  inter_i = extra_i / f                       (i = 0 .. d/2 - 1)
    dim(r)  = d log(L0 / (2 pi r)) / (2 log b)                        (the dim that turns r times over L0)
    lo, hi  = max(floor(dim(beta_fast)), 0), min(ceil(dim(beta_slow)), d - 1)
    ramp_i  = clamp((i - lo) / (hi - lo), 0, 1)                       (hi += 0.001 when lo == hi)
    inv_freq_i = inter_i ramp_i + extra_i (1 - ramp_i)
    cos, sin = cos(p inv_freq), sin(p inv_freq) on [freqs, freqs], times the concentration
    c = m(f, mscale) / m(f, mscale_all_dim),   m(f, k) = 1 if f <= 1 else 0.1 k ln f + 1

and the attention's softmax scale is ``m(f, mscale_all_dim)^2 / sqrt(qk_head_dim + d)``
(Megatron's ``MultiLatentAttention.softmax_scale``; transformers' ``yarn_apply_mscale``). With
``f = 1`` YaRN is plain RoPE and both factors are 1. ``rope_type="rope"``: plain RoPE, ``c = 1``,
the softmax scale as above (Megatron computes it from the flags whatever the RoPE type).

Megatron's concentration is ``m(f, mscale) / m(f, mscale_all_dim)`` whenever both are numbers;
transformers takes ``m(f, 1)`` when either of ``mscale``, ``mscale_all_dim`` is 0 or absent. They
agree when both are non-zero, or ``mscale = 1``; the flags here mean Megatron's.

**Pair layout.** DeepSeek's checkpoints store the RoPE part as interleaved pairs ``(x0, x1), (x2,
x3), ...``. Megatron's MLA (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``) and
transformers (``rope_interleave=True``, ``apply_rotary_pos_emb_interleave``) first gather the even
then the odd entries, ``[x0, x2, ..; x1, x3, ..]``, then rotate halves; :func:`apply_mla_rope`
does the same, so a weight imported from either computes the same. (``rope_interleave=False`` in
a Hugging Face config: permute those rows with :func:`interleave_order` on import.)
"""

from __future__ import annotations

import math

import torch

from .attention import apply_rope


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``m(f, k) = 0.1 k ln f + 1`` for ``f > 1``, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config) -> float:
    """``m(f, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``."""
    m = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return m * m / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def yarn_inv_freq(config) -> tuple[torch.Tensor, float]:
    """``(inv_freq [d/2] fp32, concentration c)`` of the module doc (plain RoPE for ``rope_type="rope"``)."""
    d, base = config.qk_pos_emb_head_dim, config.rotary_base
    extra = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if (config.rope_type or "yarn") == "rope":
        return extra, 1.0
    f = config.rotary_scaling_factor
    inter = 1.0 / (f * base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def dim_of(rotations: float) -> float:
        return d * math.log(config.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(math.floor(dim_of(config.beta_fast)), 0), min(math.ceil(dim_of(config.beta_slow)), d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1.0 - ramp  # the extrapolated (unscaled) share
    concentration = yarn_mscale(f, config.mscale) / yarn_mscale(f, config.mscale_all_dim)
    return inter * (1 - keep) + extra * keep, float(concentration)


def mla_rope_cos_sin(position_ids: torch.Tensor, config, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, 1, s, d]`` for ``position_ids [b, s]`` (fp32 math, times the concentration,
    cast to ``dtype``)."""
    inv_freq, c = yarn_inv_freq(config)
    freqs = position_ids.float().unsqueeze(-1) * inv_freq.to(position_ids.device)  # [b, s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return (emb.cos() * c).to(dtype), (emb.sin() * c).to(dtype)


def apply_mla_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [b, heads, s, d]`` stored as interleaved pairs: ``[x0, x2, ..; x1, x3, ..]``,
    then ``x cos + rotate_half(x) sin`` (module doc)."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


def interleave_order(d: int) -> torch.Tensor:
    """Row order that turns a half-split RoPE part ``[y0 .. y_{d/2-1}; y_{d/2} ..]`` (transformers'
    ``rope_interleave=False``) into the pair layout :func:`apply_mla_rope` reads: ``x[2i] = y[i]``,
    ``x[2i+1] = y[d/2 + i]``; i.e. ``x = y[interleave_order(d)]``."""
    half = d // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
