"""Multi-latent attention's arithmetic: parameters, KV cache and activations (docs/plan.md).

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` (megazero/model/mla.py's layout):
``h`` hidden, ``H`` heads, ``t`` TP, ``d_n, d_r, d_v`` (``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``), ``d_q = d_n + d_r``, ranks ``r_q`` (``q_lora_rank``; None: no query latent) and
``r_kv``, ``n(x)`` a norm's weights (``x``, or ``2x`` LayerNorm).

**Parameters on one TP rank** (the down projections and latent norms are replicated)::

    query     h r_q + n(r_q) + r_q H d_q / t        (without r_q: h H d_q / t)
    key/value h (r_kv + d_r) + n(r_kv) + r_kv H (d_n + d_v) / t
    output    H d_v h / t  (+ h bias with --add-bias-linear, whole)

**Generation cache** per token and layer (:mod:`megazero.inference.latent_cache`; ``A`` bytes a
value): ``(r_kv + d_r) A`` on every TP rank, against a K/V cache's ``2 (G/t) d A``.

**Activations** one layer keeps for one micro-batch of ``s`` tokens (2-byte units, the
Korthikanti et al. accounting of :mod:`megazero.planner.cp_memory`): a standard attention's
``Q, K`` (4 s b h / t), ``V`` and the output projection's input (2 s b h / t each) become::

    (4 H d_q + 4 H d_v) s b / t   +   (4 r_q + 4 r_kv + 2 d_r) s b  (/ t with SP)

the per-head ``q, k`` and ``v, o``, and the latents (down-projection outputs and the norms'
outputs, the un-rotated rope key). The ``5 a s^2 b / t`` scores term is unchanged (per head, any
head size). Under CP the ring's figures are counted at ``kv_channels`` (approximate for MLA).
"""

from __future__ import annotations


def _norm(shape, size: int) -> int:
    return 2 * size if shape.layernorm else size


def mla_attention_params(shape, tp: int = 1) -> int:
    """MLA's weights on one TP rank (module doc)."""
    h, H = shape.hidden_size, shape.num_attention_heads
    d_n, d_r, d_v, r_kv = shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim, shape.kv_lora_rank
    d_q = d_n + d_r
    if shape.q_lora_rank is None:
        query = h * H * d_q // tp
    else:
        query = h * shape.q_lora_rank + _norm(shape, shape.q_lora_rank) + shape.q_lora_rank * H * d_q // tp
    key_value = h * (r_kv + d_r) + _norm(shape, r_kv) + r_kv * H * (d_n + d_v) // tp
    return query + key_value + H * d_v * h // tp + (h if shape.add_bias_linear else 0)


def kv_cache_bytes_per_token(shape, tp: int = 1, value_bytes: int = 2) -> int:
    """Generation-cache bytes per token on one TP rank, all layers: MLA's latent
    ``(r_kv + d_r)``, else keys and values ``2 (G/t) d``."""
    if shape.multi_latent_attention:
        per_layer = shape.kv_lora_rank + shape.qk_pos_emb_head_dim
    else:
        per_layer = 2 * shape.num_query_groups // tp * shape.kv_channels
    return shape.num_layers * per_layer * value_bytes


def mla_activation_delta(shape, s: int, b: int, tp: int, sp: bool) -> float:
    """What one MLA layer keeps beyond the standard attention's ``8 s b h / t`` (2-byte units;
    may be negative): ``(4 H d_q + 4 H d_v - 8 h) s b / t + (4 r_q + 4 r_kv + 2 d_r) s b (/ t with SP)``."""
    if not shape.multi_latent_attention:
        return 0.0
    H, h = shape.num_attention_heads, shape.hidden_size
    d_q = shape.qk_head_dim + shape.qk_pos_emb_head_dim
    latents = 4 * (shape.q_lora_rank or 0) + 4 * shape.kv_lora_rank + 2 * shape.qk_pos_emb_head_dim
    return (4 * H * d_q + 4 * H * shape.v_head_dim - 8 * h) * s * b / tp + latents * s * b / (tp if sp else 1)
