"""Self-attention of a GPT layer over tensor parallelism, and its RoPE.

``H`` query heads and ``G`` key/value groups (GQA; ``G = H`` is MHA), ``H/p`` and ``G/p`` of them
on each TP rank (the fused QKV weight is column-parallel, the output projection row-parallel);
``softmax(Q K^T / sqrt(d) + causal) V`` through ``F.scaled_dot_product_attention(is_causal=True,
enable_gqa=...)``. When attention dropout is active (training, ``attention_dropout > 0``) the same
math runs explicitly so the probability dropout mask comes from the tracker's tensor-parallel
generator (SDPA's dropout would draw from the global RNG). RoPE uses the rotate-half convention
(Llama/Hugging Face). Under context parallelism the core attention is the ring's or the
all-to-all's (:mod:`megazero.context_parallel`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, dropout, seeded_normal
from megazero.tensor_parallel.mappings import group_size
from megazero.tensor_parallel.random import TENSOR_PARALLEL

from .config import GPTConfig


def rope_cos_sin(position_ids: torch.Tensor, dim: int, base: float, dtype):
    """cos, sin ``[b, 1, s, dim]`` for ``position_ids [b, s]`` (fp32 math, cast to ``dtype``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim))
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` on ``[b, heads, s, d]``; rotate_half(a, b) = (-b, a)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
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

    def core_attention(self, q, k, v, attention_mask=None):
        """``[b, H/p, s, d]`` x ``[b, G/p, s, d]`` x2 -> ``[b, H/p, s, d]`` causal attention.

        ``attention_mask`` (optional, ``[b, 1, s, s]`` bool, Megatron's convention: True where a
        query may NOT attend to a key; it already holds the causal part, e.g. the block-diagonal
        per-document mask of ``--reset-attention-mask``) replaces the plain causal mask."""
        p_drop = self.config.attention_dropout
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
        if self.config.cp_comm_type == "a2a":
            return ulysses_attention(q, k, v, self.cp_group, self.cp, enable_gqa=self.groups != self.heads)
        return ring_attention(q, k, v, self.cp_group, self.cp_ranks)

    def forward(self, x, rope=None, inference_cache=None, attention_mask=None):
        qkv = self.qkv(x)  # [s, b, (H + 2G) d / p]
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q = q.reshape(s, b, self.heads, self.d).permute(1, 2, 0, 3)
        k = k.reshape(s, b, self.groups, self.d).permute(1, 2, 0, 3)
        v = v.reshape(s, b, self.groups, self.d).permute(1, 2, 0, 3)
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
