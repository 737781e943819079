"""Incremental decoding for multi-latent attention: the cache holds the compressed latent, not K/V.

An MLA layer (:mod:`megazero.model.mla`) derives every head's key and value from two small
per-token vectors: ``c_kv`` (the key/value latent after its norm, ``r = kv_lora_rank`` numbers) and
``k_r`` (the RoPE key part shared by all heads, after RoPE, ``d_r = qk_pos_emb_head_dim`` numbers;
the head sizes ``d_n, d_q, d_v`` as in :mod:`megazero.model.mla`).
:class:`LatentCache` keeps exactly those, per layer ``[b, max_len, kv_lora_rank]`` and ``[b,
max_len, qk_pos_emb_head_dim]`` -- on every TP rank whole (the latent is replicated; each rank
expands its own heads from it) -- instead of the ``H/p (d_q + d_v)`` numbers per token of a K/V
cache. Per layer both live in ONE buffer ``[b, max_len, r + d_r]`` (``[c_kv; k_r]`` per slot), which
is also the absorbed attention's key.

The prefill (any step of several tokens, or the first) re-expands the cached latents with
``kv_up`` (``O(t r H/p (d_n + d_v))``) and attends as
:meth:`~megazero.inference.cache.InferenceCache.attend` does (padding mask, positions, chunked
prefill: all :class:`~megazero.inference.cache.InferenceCache`'s). A *decode* step (after the
prefill, one token per row: megatron-core's ``is_decode_only``) absorbs ``kv_up`` instead
(:meth:`megazero.model.mla.MultiLatentAttention.absorbed_attention`): queries ``[q_n W_uk_h; q_r]``
(width ``r + d_r``) attend over the buffer as one key/value head shared by all heads
(:meth:`LatentCache.attend_latent`, the same mask and scale), then ``W_uv_h`` maps each head's
``r``-wide output to ``d_v``. FLOPs per decode step, layer and row at context ``t``::

    expanded   2 t r H/p (d_n + d_v)  +  2 t H/p (d_q + d_v)          (kv_up over the cache + attention)
    absorbed   2 H/p d_n r + 2 H/p r d_v  +  2 t H/p (2 r + d_r)      (absorb q, o + attention)

so per cached token and head the absorbed step costs ``2 r + d_r`` multiply-adds against ``r (d_n +
d_v) + d_q + d_v`` (DeepSeek-V3: 1088 against 131392, 121x fewer).

Per token and layer, with ``A`` bytes per value::

    latent cache   (kv_lora_rank + qk_pos_emb_head_dim) A          on every TP rank
    K/V cache      H (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) A / TP

(DeepSeek-V3: 576 values against 128 x 320 = 40960, 71x smaller at TP 1.)
:func:`new_cache` picks the cache a model needs; ``repr`` says which and what it holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import InferenceCache


class LatentCache(InferenceCache):
    """:class:`InferenceCache` whose MLA layers store ``(c_kv, k_r)`` (module doc); a layer of
    standard attention in the same model would still use ``update`` (keys and values).
    ``absorb`` (default True): decode steps attend over the latents with the absorbed weights;
    False: every step expands them (the reference, and a benchmark's baseline)."""

    def __init__(self, batch_size: int, max_len: int, device=None, config=None, absorb: bool = True):
        super().__init__(batch_size, max_len, device)
        self.buffers: dict[int, torch.Tensor] = {}  # per layer [b, max_len, r + d_r]: [c_kv; k_r] per slot
        self.latents: dict[int, torch.Tensor] = {}  # views of the buffers: c_kv [b, max_len, r]
        self.rope_keys: dict[int, torch.Tensor] = {}  # k_r [b, max_len, d_r]
        self.config, self.absorb = config, bool(absorb)

    def update_latent(self, layer: int, c_kv: torch.Tensor, k_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``c_kv [b, s, r]`` and ``k_r [b, s, d_r]`` at this step's slots; return those of slots
        ``0 .. offset+s-1``."""
        if layer not in self.buffers:
            r, d_r = c_kv.shape[-1], k_r.shape[-1]
            buf = torch.empty(c_kv.shape[0], self.max_len, r + d_r, dtype=c_kv.dtype, device=c_kv.device)
            self.buffers[layer], self.latents[layer], self.rope_keys[layer] = buf, buf[..., :r], buf[..., r:]
        end = self.offset + c_kv.shape[1]
        self.latents[layer][:, self.offset:end] = c_kv
        self.rope_keys[layer][:, self.offset:end] = k_r
        return self.latents[layer][:, :end], self.rope_keys[layer][:, :end]

    def absorbs(self) -> bool:
        """Whether this step attends with absorbed weights: a decode-only step -- after the prefill,
        one new token per row -- as megatron-core 0.16.1 absorbs only when
        ``inference_context.is_decode_only()`` (transformer/multi_latent_attention.py,
        ``qkv_up_proj_and_rope_apply_for_cached_latent_kv``); the prefill expands (cheaper there)."""
        return self.absorb and self.offset > 0 and self.step_len == 1

    def attend_latent(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``softmax(q K^T scale + mask) V`` for ``q [b, H/p, s, r + d_r]`` over this layer's slots
        ``0 .. offset+s-1`` with ONE key ``K = [c_kv; k_r]`` and value ``V = c_kv`` shared by every
        head (the cache's buffer itself: no copy); the heads are folded into the query rows, each
        keeping its slot's mask row (module doc of :mod:`.cache`). Returns ``[b, H/p, s, r]``."""
        b, heads, s, width = q.shape
        end = self.offset + s
        kv = self.buffers[layer][:, :end].unsqueeze(1)  # [b, 1, t, r + d_r]
        r = self.latents[layer].shape[-1]
        mask = self.mask
        if mask is None and s > 1:  # causal, the diagonal at the step's first slot
            q_idx = torch.arange(self.offset, end, device=q.device).unsqueeze(1)
            mask = (torch.arange(end, device=q.device).unsqueeze(0) <= q_idx).view(1, 1, s, end)
        if mask is not None:
            mask = mask.expand(b, heads, s, end).reshape(b, 1, heads * s, end)
        out = F.scaled_dot_product_attention(q.reshape(b, 1, heads * s, width), kv, kv[..., :r], attn_mask=mask,
                                             scale=scale)
        return out.view(b, heads, s, r)

    def nbytes(self) -> int:
        """Bytes allocated for every layer's latents and RoPE keys (and any standard K/V)."""
        tensors = [*self.buffers.values(), *self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        c = self.config
        per = "kv_lora_rank + qk_pos_emb_head_dim" if c is None else (
            f"kv_lora_rank {c.kv_lora_rank} + qk_pos_emb_head_dim {c.qk_pos_emb_head_dim} values per token and layer"
            f" (full K/V: {c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim)})")
        return (f"LatentCache(batch {self.batch_size}, max_len {self.max_len}: multi-latent attention caches the "
                f"compressed latent, not K/V: {per}; {len(self.latents)} layers, {self.nbytes()} bytes)")


def cache_note(config) -> str | None:
    """One line for a multi-latent-attention or sliding-window model's generation log (None otherwise)."""
    if getattr(config, "window_size", None) is not None:
        return (f"> sliding window (--window-size {config.window_size[0]},0): the KV cache holds each layer's last "
                f"{config.window_size[0]} positions")
    if not getattr(config, "multi_latent_attention", False):
        return None
    full = config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim)
    return (f"> multi-latent attention: the KV cache holds each layer's compressed latent (kv_lora_rank "
            f"{config.kv_lora_rank} + RoPE key {config.qk_pos_emb_head_dim} values per token), not K/V ({full})")


def new_cache(config, batch_size: int, max_len: int, device=None, **options) -> InferenceCache:
    """The cache ``config``'s model generates with: :class:`LatentCache` for multi-latent
    attention, else :class:`~megazero.inference.cache.InferenceCache` (``options``: its keyword
    arguments). The latent cache keeps every position: an option set (not None) is refused."""
    if getattr(config, "multi_latent_attention", False):
        given = sorted(k for k, v in options.items() if v is not None)
        if given:
            raise ValueError(f"the multi-latent-attention cache takes no {', '.join(given)} (it keeps every position)")
        return LatentCache(batch_size, max_len, device, config)
    return InferenceCache(batch_size, max_len, device, **options)
