"""One pre-norm transformer layer built from tensor-parallel pieces.

``x`` is ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism). Per layer::

    x = x + dropout(Attention(Norm(x)))        # QKV column-parallel, dense row-parallel
    x = x + dropout(MLP(Norm(x)))              # fc1 column-parallel, fc2 row-parallel

Each TP region costs one ``f``/``g`` pair: without SP an all-reduce in forward (``g`` after the
row-parallel linear) and one in backward (``f`` before the column-parallel linear); with SP an
all-gather + reduce-scatter pair in each direction instead (same volume, activations between
regions stored ``1/p`` as large).

Attention: ``H`` query heads and ``G`` key/value groups (GQA; ``G = H`` is MHA), ``H/p`` and
``G/p`` of them on each TP rank; ``softmax(Q K^T / sqrt(d) + causal) V`` through
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=...)``. When attention dropout is
active (training, ``attention_dropout > 0``) the same math runs explicitly so the probability
dropout mask comes from the tracker's tensor-parallel generator (SDPA's dropout would draw from
the global RNG). RoPE uses the rotate-half convention (Llama/Hugging Face).

Sequence parallelism: a norm's parameters are replicated while its input is split along the
sequence, so each rank's gradient is partial; they pass through ``f`` (identity forward,
all-reduce backward) so the gradient that reaches the parameter is already the TP sum.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, checkpoint, copy_to_tp_region,
                                      dropout, seeded_normal)
from megazero.tensor_parallel.activations import activate
from megazero.tensor_parallel.mappings import group_size
from megazero.tensor_parallel.random import REPLICATED, TENSOR_PARALLEL

from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention
from megazero.moe.layer import MoELayer

from .config import GPTConfig


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim; replicated params, TP-summed grads under SP.

    ``config.apply_layernorm_1p`` (Megatron's ``--apply-layernorm-1p``, its config's
    ``layernorm_zero_centered_gamma``): the stored weight ``w`` starts at 0 and the norm scales
    by ``1 + w`` (LayerNorm: ``(1 + w) * (x - mean) / sqrt(var + eps) + b``; RMSNorm:
    ``(1 + w) * x / sqrt(mean(x^2) + eps)``), as Megatron-LM's FusedLayerNorm and Transformer
    Engine's ``zero_centered_gamma`` do.
    """

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool, device):
        super().__init__()
        self.kind, self.eps, self.tp_group = config.normalization, config.norm_epsilon, tp_group
        self.sequence_parallel = sequence_parallel
        self.one_plus = config.apply_layernorm_1p
        h = config.hidden_size
        start = torch.zeros if self.one_plus else torch.ones
        self.param_inits = {"weight": lambda: start(h)}  # values for a meta-device build
        self.weight = nn.Parameter(start(h, dtype=config.params_dtype, device=device))
        if self.kind == "LayerNorm":
            self.param_inits["bias"] = lambda: torch.zeros(h)
            self.bias = nn.Parameter(torch.zeros(h, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_tp_region(w, self.tp_group)
            b = None if b is None else copy_to_tp_region(b, self.tp_group)
        if self.one_plus:
            w = w + 1
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


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


class MLP(nn.Module):
    """``fc2(act(fc1 x))`` over TP; ``ffn_hidden_size``/``key`` default to the layer's dense MLP
    (the MoE shared expert passes its own)."""

    def __init__(self, config: GPTConfig, layer_number: int, tp_group, device, ffn_hidden_size: int | None = None,
                 key: str | None = None):
        super().__init__()
        self.activation, f = config.activation, ffn_hidden_size or config.ffn_hidden_size
        key = key or f"layers.{layer_number}.mlp"
        std, seed, sp = config.init_method_std, config.seed, config.sequence_parallel
        swiglu = self.activation == "swiglu"
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * f if swiglu else f, tp_group,
                                        bias=config.add_bias_linear, sequence_parallel=sp,
                                        partition_sizes=[f, f] if swiglu else None,
                                        init_method=seeded_normal(std, seed, f"{key}.fc1.weight"),
                                        params_dtype=config.params_dtype, device=device)
        self.fc2 = RowParallelLinear(f, config.hidden_size, tp_group, bias=config.add_bias_linear,
                                     input_is_parallel=True, skip_bias_add=True, sequence_parallel=sp,
                                     init_method=seeded_normal(std / math.sqrt(2 * config.num_layers), seed,
                                                               f"{key}.fc2.weight"),
                                     params_dtype=config.params_dtype, device=device)

    def forward(self, x):
        return self.fc2(activate(self.fc1(x), self.activation))


class TransformerLayer(nn.Module):
    """Pre-norm layer number ``layer_number`` (global, 0-based); its MLP is an MoE block
    (:class:`~megazero.moe.layer.MoELayer`, over ``topo``'s expert groups, sharing ``moe_state``)
    where the config's MoE layer pattern says so."""

    def __init__(self, config: GPTConfig, layer_number: int, tp_group, tracker, device, topo=None, moe_state=None,
                 buffer_device=None):
        super().__init__()
        sp = config.sequence_parallel and group_size(tp_group) > 1
        self.config, self.tracker, self.layer_number = config, tracker, layer_number
        # hidden dropout acts on split activations under SP (different tokens per rank)
        self.dropout_rng = TENSOR_PARALLEL if sp else REPLICATED
        self.input_norm = Norm(config, tp_group, sp, device)
        self.attention = Attention(config, layer_number, tp_group, tracker, device, topo)
        self.post_attention_norm = Norm(config, tp_group, sp, device)
        if config.moe is not None and config.moe.is_moe(layer_number):
            shared = None
            if config.moe.shared_expert_intermediate_size:
                shared = MLP(config, layer_number, tp_group, device,
                             ffn_hidden_size=config.moe.shared_expert_intermediate_size,
                             key=f"layers.{layer_number}.mlp.shared_expert")
            self.mlp = MoELayer(config, layer_number, topo, tracker, moe_state, device, buffer_device or device,
                                shared_expert=shared)
        else:
            self.mlp = MLP(config, layer_number, tp_group, device)

    def _bias_dropout_add(self, out, bias, residual):
        if bias is not None:
            out = out + bias
        return residual + dropout(out, self.config.hidden_dropout, self.training, self.tracker, self.dropout_rng)

    def forward(self, x, rope=None, inference_cache=None, attention_mask=None):
        out, bias = self.attention(self.input_norm(x), rope, inference_cache, attention_mask)
        x = self._bias_dropout_add(out, bias, x)
        out, bias = self.mlp(self.post_attention_norm(x))
        return self._bias_dropout_add(out, bias, x)
