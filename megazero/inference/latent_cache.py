"""Incremental decoding for multi-latent attention: the cache holds the compressed latent, not K/V.

An MLA layer (:mod:`megazero.model.mla`) derives every head's key and value from two small
per-token vectors: ``c_kv`` (the key/value latent after its norm, ``kv_lora_rank`` numbers) and
``k_r`` (the RoPE key part shared by all heads, after RoPE, ``qk_pos_emb_head_dim`` numbers).
:class:`LatentCache` keeps exactly those, per layer ``[b, max_len, kv_lora_rank]`` and ``[b,
max_len, qk_pos_emb_head_dim]`` -- on every TP rank whole (the latent is replicated; each rank
expands its own heads from it) -- instead of the ``H/p (d_q + d_v)`` numbers per token of a K/V
cache. Each step the layer re-expands the cached latents with ``kv_up`` (``O(t r H (d_n + d_v)/p)``
per step: memory for compute; no weight absorption), then attends as
:meth:`~megazero.inference.cache.InferenceCache.attend` does (padding mask, positions, chunked
prefill: all :class:`~megazero.inference.cache.InferenceCache`'s).

Per token and layer, with ``A`` bytes per value::

    latent cache   (kv_lora_rank + qk_pos_emb_head_dim) A          on every TP rank
    K/V cache      H (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) A / TP

(DeepSeek-V3: 576 values against 128 x 320 = 40960, 71x smaller at TP 1.)
:func:`new_cache` picks the cache a model needs; ``repr`` says which and what it holds.
"""

from __future__ import annotations

import torch

from .cache import InferenceCache


class LatentCache(InferenceCache):
    """:class:`InferenceCache` whose MLA layers store ``(c_kv, k_r)`` (module doc); a layer of
    standard attention in the same model would still use ``update`` (keys and values)."""

    def __init__(self, batch_size: int, max_len: int, device=None, config=None):
        super().__init__(batch_size, max_len, device)
        self.latents: dict[int, torch.Tensor] = {}
        self.rope_keys: dict[int, torch.Tensor] = {}
        self.config = config

    def update_latent(self, layer: int, c_kv: torch.Tensor, k_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``c_kv [b, s, r]`` and ``k_r [b, s, d_r]`` at this step's slots; return those of slots
        ``0 .. offset+s-1``."""
        if layer not in self.latents:
            b = c_kv.shape[0]
            self.latents[layer] = torch.empty(b, self.max_len, c_kv.shape[-1], dtype=c_kv.dtype, device=c_kv.device)
            self.rope_keys[layer] = torch.empty(b, self.max_len, k_r.shape[-1], dtype=k_r.dtype, device=k_r.device)
        end = self.offset + c_kv.shape[1]
        self.latents[layer][:, self.offset:end] = c_kv
        self.rope_keys[layer][:, self.offset:end] = k_r
        return self.latents[layer][:, :end], self.rope_keys[layer][:, :end]

    def nbytes(self) -> int:
        """Bytes allocated for every layer's latents and RoPE keys (and any standard K/V)."""
        tensors = [*self.latents.values(), *self.rope_keys.values(), *self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        c = self.config
        per = "kv_lora_rank + qk_pos_emb_head_dim" if c is None else (
            f"kv_lora_rank {c.kv_lora_rank} + qk_pos_emb_head_dim {c.qk_pos_emb_head_dim} values per token and layer"
            f" (full K/V: {c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim)})")
        return (f"LatentCache(batch {self.batch_size}, max_len {self.max_len}: multi-latent attention caches the "
                f"compressed latent, not K/V: {per}; {len(self.latents)} layers, {self.nbytes()} bytes)")


def cache_note(config) -> str | None:
    """One line for a multi-latent-attention model's generation log (None otherwise)."""
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
