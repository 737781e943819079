"""Self-attention of a GPT layer over tensor parallelism, and its RoPE.

``H`` query heads and ``G`` key/value groups (GQA; ``G = H`` is MHA), ``H/p`` and ``G/p`` of them
on each TP rank (the fused QKV weight is column-parallel, the output projection row-parallel);
``softmax(Q K^T / sqrt(d) + causal) V`` through ``F.scaled_dot_product_attention(is_causal=True,
enable_gqa=...)``. When attention dropout is active (training, ``attention_dropout > 0``) the same
math runs explicitly so the probability dropout mask comes from the tracker's tensor-parallel
generator (SDPA's dropout would draw from the global RNG). RoPE uses the rotate-half convention
(Llama/Hugging Face). Under context parallelism the core attention is the ring's or the
all-to-all's (:mod:`megazero.context_parallel`).

**QK normalization** (``config.qk_layernorm``, Megatron-LM's ``--qk-layernorm``; transformers'
``Qwen3Attention.q_norm`` / ``k_norm``): before RoPE, each head's query and key vector
``x in R^d`` is normalized by the config's ``normalization`` (RMSNorm ``w * x / sqrt(mean(x^2) +
eps)``, or LayerNorm with a bias), one weight ``w in R^d`` for all query heads and one for all
key heads (:class:`HeadNorm`). The weights are replicated on the TP ranks while each rank holds
``H/p`` of the heads, so each rank's weight gradient is the part from its heads: the weight goes
through ``f`` (identity forward, all-reduce over TP backward) and reaches the optimizer as the
sum over all heads, equal on every TP rank (as megatron-core's finalize_model_grads sums the
``q_layernorm`` / ``k_layernorm`` gradients over TP).

**Sliding window** (``config.window_size = (left, 0)``, Megatron-LM's ``--window-size``, its
``get_sliding_window_causal_mask``): query ``i`` attends keys ``j`` with ``i - left <= j <= i``
(HF Mistral's ``sliding_window`` ``W``, keys ``i - W < j <= i``, is ``left = W - 1``):
:func:`window_mask`, intersected with any document mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, dropout, seeded_normal
from megazero.tensor_parallel.mappings import copy_to_tp_region, group_size
from megazero.tensor_parallel.random import TENSOR_PARALLEL

from .config import GPTConfig


def rope_cos_sin(position_ids: torch.Tensor, dim: int, base: float, dtype):
    """cos, sin ``[b, 1, s, dim]`` for ``position_ids [b, s]`` (fp32 math, cast to ``dtype``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim))
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` on ``[b, heads, s, d]``; rotate_half(a, b) = (-b, a). The
    tables take ``x``'s dtype (as megatron-core's ``_apply_rotary_pos_emb_bshd``): a module cast
    after it was built (``megazero.initialize`` with fp16) keeps q, k and v in one dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, left: int | None) -> torch.Tensor:
    """``[len(q_pos), len(k_pos)]`` bool, True where query position ``i`` may attend key ``j``:
    ``j <= i`` and (with a window) ``i - j <= left``."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    return (diff >= 0) if left is None else (diff >= 0) & (diff <= left)


class HeadNorm(nn.Module):
    """The config's norm over the last dim (``kv_channels``) of ``[b, heads, s, d]``, one weight
    (and LayerNorm bias) shared by the heads, replicated over TP with TP-summed gradients (module
    doc); ``apply_layernorm_1p`` applies ``1 + w`` as the other norms do."""

    def __init__(self, config: GPTConfig, tp_group, device):
        super().__init__()
        d, self.tp_group = config.kv_channels, tp_group
        self.layernorm, self.eps, self.one_plus = config.layernorm, config.norm_epsilon, config.apply_layernorm_1p
        start = torch.zeros if self.one_plus else torch.ones
        self.param_inits = {"weight": lambda: start(d)}  # values for a meta-device build
        self.weight = nn.Parameter(start(d, dtype=config.params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(d, dtype=config.params_dtype, device=device)) if self.layernorm else None
        if self.layernorm:
            self.param_inits["bias"] = lambda: torch.zeros(d)

    def forward(self, x):
        w = copy_to_tp_region(self.weight, self.tp_group)
        b = None if self.bias is None else copy_to_tp_region(self.bias, self.tp_group)
        w = w + 1 if self.one_plus else w
        if self.layernorm:
            return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class Attention(nn.Module):
    """Self-attention of layer ``layer_number`` (module doc); with ``qk_layernorm`` its
    ``q_norm`` / ``k_norm`` (:class:`HeadNorm`)."""

    def __init__(self, config: GPTConfig, layer_number: int, tp_group, tracker, device, topo=None):
        super().__init__()
        self.cp = topo.cp if topo is not None else 1  # context parallelism: attention over the CP ring
        self.cp_group = topo.group("cp") if self.cp > 1 else None
        self.cp_ranks = topo.rank_lists.get("cp", []) if self.cp > 1 else []
        p = group_size(tp_group)
        self.config, self.tracker, self.d = config, tracker, config.kv_channels
        self.heads, self.groups = config.num_attention_heads // p, config.num_query_groups // p
        self.layer_number = layer_number
        q, kv = config.num_attention_heads * self.d, config.num_query_groups * self.d
        key = f"layers.{layer_number}.attention"
        std, seed, sp = config.init_method_std, config.seed, config.sequence_parallel
        self.qkv = ColumnParallelLinear(config.hidden_size, q + 2 * kv, tp_group, bias=config.qkv_bias,
                                        sequence_parallel=sp, partition_sizes=[q, kv, kv],
                                        init_method=seeded_normal(std, seed, f"{key}.qkv.weight"),
                                        params_dtype=config.params_dtype, device=device)
        self.dense = RowParallelLinear(q, config.hidden_size, tp_group, bias=config.add_bias_linear,
                                       input_is_parallel=True, skip_bias_add=True, sequence_parallel=sp,
                                       init_method=seeded_normal(std / math.sqrt(2 * config.num_layers), seed,
                                                                 f"{key}.dense.weight"),
                                       params_dtype=config.params_dtype, device=device)
        if config.qk_layernorm:
            self.q_norm, self.k_norm = HeadNorm(config, tp_group, device), HeadNorm(config, tp_group, device)

    def core_attention(self, q, k, v, attention_mask=None):
        """``[b, H/p, s, d]`` x ``[b, G/p, s, d]`` x2 -> ``[b, H/p, s, d]`` causal attention.

        ``attention_mask`` (optional, ``[b, 1, s, s]`` bool, Megatron's convention: True where a
        query may NOT attend to a key; it already holds the causal part, e.g. the block-diagonal
        per-document mask of ``--reset-attention-mask``) replaces the plain causal mask."""
        p_drop, left = self.config.attention_dropout, self.config.window_left
        if left is not None and left < q.shape[-2] - 1:  # a window shorter than the sequence (with any
            # document mask): one mask; a longer window is the plain causal mask
            pos = torch.arange(q.shape[-2], device=q.device)
            outside = ~window_mask(pos, pos, left)
            attention_mask = outside if attention_mask is None else attention_mask | outside
        if not (self.training and p_drop > 0):
            if attention_mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                  enable_gqa=self.groups != self.heads)
        rep = self.heads // self.groups
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.d))
        masked = attention_mask if attention_mask is not None else (
            torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1))
        probs = torch.softmax(scores.float().masked_fill(masked, float("-inf")), dim=-1).to(q.dtype)
        probs = dropout(probs, p_drop, True, self.tracker, TENSOR_PARALLEL)
        return torch.matmul(probs, v)

    def context_parallel_attention(self, q, k, v, attention_mask=None):
        """Causal attention over the whole sequence spread on the CP group
        (:mod:`megazero.context_parallel.ring`, :mod:`~megazero.context_parallel.ulysses`): the ring (``p2p``) or all-to-all (``a2a``)."""
        if attention_mask is not None:
            raise ValueError("--reset-attention-mask is not supported with context parallelism")
        left = self.config.window_left
        if self.config.cp_comm_type == "a2a":
            return ulysses_attention(q, k, v, self.cp_group, self.cp, enable_gqa=self.groups != self.heads,
                                     window=left)
        return ring_attention(q, k, v, self.cp_group, self.cp_ranks, window=left)

    def forward(self, x, rope=None, inference_cache=None, attention_mask=None):
        qkv = self.qkv(x)  # [s, b, (H + 2G) d / p]
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q = q.reshape(s, b, self.heads, self.d).permute(1, 2, 0, 3)
        k = k.reshape(s, b, self.groups, self.d).permute(1, 2, 0, 3)
        v = v.reshape(s, b, self.groups, self.d).permute(1, 2, 0, 3)
        if self.config.qk_layernorm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if inference_cache is not None:  # incremental decoding (megazero.inference.cache)
            k, v = inference_cache.update(self.layer_number, k, v)
            ctx = inference_cache.attend(q, k, v)
        elif self.cp > 1:
            ctx = self.context_parallel_attention(q, k, v, attention_mask)
        elif self.config.recompute_granularity == "selective" and self.training:
            ctx = checkpoint(self.core_attention, self.tracker, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d)
        return self.dense(ctx)
