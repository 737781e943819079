"""Multi-latent attention (MLA, DeepSeek-V2/V3) over tensor parallelism.

For hidden states ``x`` (``[s, b, h]``), ``H`` heads, query/key head ``d_q = d_n + d_r``
(``qk_head_dim`` + ``qk_pos_emb_head_dim``), value head ``d_v``, latent ranks ``r_q``
(``q_lora_rank``, optional) and ``r_kv`` (``kv_lora_rank``)::

    c_q        = Norm(x W_qd)                        [s, b, r_q]     (q_down, q_norm)
    q          = c_q W_qu            (or x W_q)      [s, b, H d_q]   (q_up, or q_proj without r_q)
    [c_kv; k_r] = x W_kvd                            [s, b, r_kv + d_r]   (kv_down)
    c_kv       = Norm(c_kv)                                          (kv_norm)
    [k_n; v]   = c_kv W_kvu                          [s, b, H (d_n + d_v)] (kv_up, per head [k_n, v])
    q = [q_n; RoPE(q_r)],  k = [k_n; RoPE(k_r)]      (k_r: ONE key part shared by all heads)
    o = softmax(q k^T * scale + causal) v,   scale = m^2 / sqrt(d_q)  (:func:`.yarn.softmax_scale`)
    y = o W_o                                        (dense)

RoPE is YaRN's on DeepSeek's pair layout (:mod:`.yarn`). The norms are RMSNorm (or LayerNorm:
``config.normalization``), eps ``norm_epsilon``. Biases: only the output projection's, with
``add_bias_linear`` (Megatron's MLA: the down and up projections have none).

**Tensor parallelism** (``p`` ranks; Megatron's TE spec ``get_gpt_layer_with_transformer_engine_spec
(multi_latent_attention=True)``, megatron/core/models/gpt/gpt_layer_specs.py core_v0.16.1: the down
projections are ``TELinear(parallel_mode='duplicated')``, the up projections column-parallel, the
output row-parallel). ``q_down`` and ``kv_down`` (and the two norms) are *replicated*: every rank
computes the small latents whole, so no gather of a split latent is needed. ``q_up``/``q_proj`` and
``kv_up`` are column-parallel by head (rank ``r`` holds heads ``r H/p .. (r+1) H/p - 1``, each
head's rows contiguous), ``dense`` row-parallel. The shared rope key ``k_r`` is used by every
rank's heads, so its gradient is summed over TP: ``f`` (identity forward, all-reduce backward)
without SP.

**Sequence parallelism**: the input is ``[s/p, b, h]``; the down projections and norms run on the
rank's ``s/p`` tokens (their replicated weights pass through ``f`` so their gradients are
TP-summed), the up projections all-gather the *latents* (``r_q`` and ``r_kv`` wide, not ``h``)
along the sequence, and ``k_r`` is all-gathered (backward: reduce-scatter). Megatron does the same.

**Context parallelism**: the ring / all-to-all attention of :mod:`megazero.context_parallel` with
``q`` pre-multiplied by ``scale sqrt(d)`` (they scale by ``1/sqrt(d)``); the ring's fused kernels
take one head size, so the narrower of ``q, k`` and ``v`` is zero-padded (exact).

**Generation** caches the latent, not K/V: per layer and token ``c_kv`` (after its norm) and the
rotated ``k_r`` -- ``r_kv + d_r`` numbers instead of ``H (d_q + d_v)``
(:mod:`megazero.inference.latent_cache`). The prefill (and any step of several tokens) expands them
with ``kv_up``; a decode step (one new token per row after the prefill: Megatron's
``is_decode_only``) absorbs ``kv_up`` into the query and the output instead
(:meth:`MultiLatentAttention.absorbed_attention`), attending over the cache directly.

Parameter names (this module / Hugging Face ``DeepseekV3Attention`` / Megatron ``MLASelfAttention``):
``q_down`` / ``q_a_proj`` / ``linear_q_down_proj``; ``q_norm`` / ``q_a_layernorm`` / ``q_layernorm``;
``q_up`` / ``q_b_proj`` / ``linear_q_up_proj``; ``q_proj`` / ``q_proj`` / ``linear_q_proj``;
``kv_down`` / ``kv_a_proj_with_mqa`` / ``linear_kv_down_proj``; ``kv_norm`` / ``kv_a_layernorm`` /
``kv_layernorm``; ``kv_up`` / ``kv_b_proj`` / ``linear_kv_up_proj``; ``dense`` / ``o_proj`` / ``linear_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, dropout, seeded_normal
from megazero.tensor_parallel.layers import TPLayer
from megazero.tensor_parallel.mappings import copy_to_tp_region, gather_from_sequence_parallel_region, group_size
from megazero.tensor_parallel.random import TENSOR_PARALLEL

from .config import GPTConfig
from .yarn import apply_mla_rope, softmax_scale


class ReplicatedLinear(TPLayer):
    """``Y = X W^T`` with ``W`` whole on every TP rank (no bias). Under sequence parallelism each
    rank sees other tokens, so ``W`` passes through ``f`` and its gradient is the TP sum."""

    def __init__(self, in_features: int, out_features: int, tp_group, *, sequence_parallel: bool, init_method,
                 params_dtype, device):
        super().__init__()
        self.tp_group, self.partitions, self.param_inits = tp_group, {}, {}
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        shape = (out_features, in_features)

        def full() -> torch.Tensor:
            weight = torch.empty(shape)
            init_method(weight)
            return weight
        self.weight = self._make("weight", shape, full, params_dtype, device)

    def forward(self, x):
        w = copy_to_tp_region(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        return F.linear(x, w)


class LatentNorm(nn.Module):
    """``config.normalization`` over a latent of ``size`` (replicated; TP-summed grads under SP;
    ``apply_layernorm_1p``: weight stored as ``w``, applied as ``1 + w``)."""

    def __init__(self, size: int, config: GPTConfig, tp_group, sequence_parallel: bool, device):
        super().__init__()
        self.layernorm, self.eps, self.one_plus = config.layernorm, config.norm_epsilon, config.apply_layernorm_1p
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel and group_size(tp_group) > 1
        start = torch.zeros if self.one_plus else torch.ones
        self.param_inits = {"weight": lambda: start(size)}
        self.weight = nn.Parameter(start(size, dtype=config.params_dtype, device=device))
        self.bias = None
        if self.layernorm:
            self.param_inits["bias"] = lambda: torch.zeros(size)
            self.bias = nn.Parameter(torch.zeros(size, dtype=config.params_dtype, device=device))

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_tp_region(w, self.tp_group)
            b = None if b is None else copy_to_tp_region(b, self.tp_group)
        w = w + 1 if self.one_plus else w
        if self.layernorm:
            return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class MultiLatentAttention(nn.Module):
    """MLA of layer ``layer_number`` (global, 0-based); same call as :class:`.attention.Attention`:
    ``forward(x, rope=(cos, sin) of .yarn.mla_rope_cos_sin, inference_cache=None, attention_mask=None)``
    -> ``(out, bias)``."""

    def __init__(self, config: GPTConfig, layer_number: int, tp_group, tracker, device, topo=None):
        super().__init__()
        c, p = config, group_size(tp_group)
        self.cp = topo.cp if topo is not None else 1
        self.cp_group = topo.group("cp") if self.cp > 1 else None
        self.cp_ranks = topo.rank_lists.get("cp", []) if self.cp > 1 else []
        self.config, self.tracker, self.layer_number, self.heads = c, tracker, layer_number, c.num_attention_heads // p
        self.d_n, self.d_r, self.d_v, self.d_q = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, \
            c.qk_head_dim + c.qk_pos_emb_head_dim
        self.scale = softmax_scale(c)
        sp = c.sequence_parallel and p > 1
        key, H, h = f"layers.{layer_number}.attention", c.num_attention_heads, c.hidden_size
        common = dict(params_dtype=c.params_dtype, device=device)

        def init(name, std=c.init_method_std):
            return seeded_normal(std, c.seed, f"{key}.{name}.weight")

        def column(name, in_features, out_features):
            return ColumnParallelLinear(in_features, out_features, tp_group, bias=False, sequence_parallel=sp,
                                        init_method=init(name), **common)
        if c.q_lora_rank is None:
            self.q_proj = column("q_proj", h, H * self.d_q)
        else:
            self.q_down = ReplicatedLinear(h, c.q_lora_rank, tp_group, sequence_parallel=sp,
                                           init_method=init("q_down"), **common)
            self.q_norm = LatentNorm(c.q_lora_rank, c, tp_group, sp, device)
            self.q_up = column("q_up", c.q_lora_rank, H * self.d_q)
        self.kv_down = ReplicatedLinear(h, c.kv_lora_rank + self.d_r, tp_group, sequence_parallel=sp,
                                        init_method=init("kv_down"), **common)
        self.kv_norm = LatentNorm(c.kv_lora_rank, c, tp_group, sp, device)
        self.kv_up = column("kv_up", c.kv_lora_rank, H * (self.d_n + self.d_v))
        self.dense = RowParallelLinear(H * self.d_v, h, tp_group, bias=c.add_bias_linear, input_is_parallel=True,
                                       skip_bias_add=True, sequence_parallel=sp,
                                       init_method=init("dense", c.init_method_std / math.sqrt(2 * c.num_layers)),
                                       **common)
        self.tp_group, self.sequence_parallel = tp_group, sp

    def _heads(self, t, width):
        """``[s, b, heads * width]`` -> ``[b, heads, s, width]``."""
        s, b = t.shape[:2]
        return t.reshape(s, b, self.heads, width).permute(1, 2, 0, 3)

    def latents(self, x, rope):
        """``q [b, H/p, s, d_q]`` (RoPE applied), ``c_kv [s, b, r_kv]`` (normed; ``s/p`` rows under SP) and
        the rotated shared key part ``k_r [b, 1, s, d_r]``."""
        if self.config.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_up(self.q_norm(self.q_down(x)))
        q_n, q_r = self._heads(q, self.d_q).split([self.d_n, self.d_r], dim=-1)
        c_kv, k_r = self.kv_down(x).split([self.config.kv_lora_rank, self.d_r], dim=-1)
        if self.sequence_parallel:
            k_r = gather_from_sequence_parallel_region(k_r, self.tp_group)
        else:
            k_r = copy_to_tp_region(k_r, self.tp_group)  # every rank's heads read it: TP-summed gradient
        k_r = k_r.permute(1, 0, 2).unsqueeze(1)  # [b, 1, s, d_r]
        if rope is not None:
            q_r, k_r = apply_mla_rope(q_r, *rope), apply_mla_rope(k_r, *rope)
        return torch.cat([q_n, q_r], dim=-1), self.kv_norm(c_kv), k_r

    def expand(self, c_kv, k_r):
        """``k [b, H/p, t, d_q]``, ``v [b, H/p, t, d_v]`` from ``c_kv [t, b, r_kv]`` and ``k_r [b, 1, t, d_r]``."""
        k_n, v = self._heads(self.kv_up(c_kv), self.d_n + self.d_v).split([self.d_n, self.d_v], dim=-1)
        return torch.cat([k_n, k_r.expand(-1, self.heads, -1, -1)], dim=-1), v

    def absorbed_attention(self, q, cache):
        """Attention over the layer's cached latents without expanding them (weight absorption).
        With head ``h``'s rows of ``kv_up`` ``[W_uk_h; W_uv_h]`` (``[d_n, r]``, ``[d_v, r]``: a view of
        this rank's weight, read at each call, so never stale): ``q_n k_n^T = (q_n W_uk_h) c_kv^T`` and
        ``P v = (P c_kv) W_uv_h^T``, so ``o_h = softmax([q_n W_uk_h; q_r] [c_kv; k_r]^T scale + mask)
        c_kv W_uv_h^T`` -- one key/value head shared by all heads (MQA, key width ``r + d_r``, value
        ``r``), the same ``scale``; ``q [b, H/p, s, d_q]`` -> ``[b, H/p, s, d_v]``."""
        w = self.kv_up.weight.view(self.heads, self.d_n + self.d_v, self.config.kv_lora_rank)
        q_n, q_r = q.split([self.d_n, self.d_r], dim=-1)
        q_latent = torch.cat([torch.matmul(q_n, w[:, :self.d_n]), q_r], dim=-1)  # [b, H/p, s, r + d_r]
        o_latent = cache.attend_latent(self.layer_number, q_latent, self.scale)  # [b, H/p, s, r]
        return torch.matmul(o_latent, w[:, self.d_n:].transpose(1, 2))

    def core_attention(self, q, k, v, attention_mask=None):
        """``softmax(q k^T scale + mask) v`` (mask: Megatron's True = not attended; None: causal);
        with attention dropout (training) explicitly, the mask drawn from the TP generator."""
        p_drop = self.config.attention_dropout
        if not (self.training and p_drop > 0):
            if attention_mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale)
        s = q.shape[-2]
        masked = attention_mask if attention_mask is not None else (
            torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        probs = torch.softmax(scores.float().masked_fill(masked, float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(dropout(probs, p_drop, True, self.tracker, TENSOR_PARALLEL), v)

    def prescaled(self, q, d=None):
        """``q scale sqrt(d)`` (``d``: ``d_q``): kernels that scale by ``1/sqrt(d)`` then use ``scale``."""
        factor = self.scale * math.sqrt(d or self.d_q)
        return q if factor == 1.0 else q * factor

    def context_parallel_attention(self, q, k, v):
        """Over the CP group: Ulysses' all-to-all (SDPA after it), or the ring, whose fused block
        kernels want one head size: the narrower of ``q, k`` / ``v`` is zero-padded to ``d =
        max(d_q, d_v)`` (zero columns add nothing to ``q k^T``; ``v``'s give zero output columns,
        cut off) and the scale taken at ``d``."""
        if self.config.cp_comm_type == "a2a":
            return ulysses_attention(self.prescaled(q), k, v, self.cp_group, self.cp, enable_gqa=False)
        d = max(self.d_q, self.d_v)
        q, k, v = (F.pad(t, (0, d - t.shape[-1])) for t in (self.prescaled(q, d), k, v))
        return ring_attention(q, k, v, self.cp_group, self.cp_ranks)[..., :self.d_v]

    def forward(self, x, rope=None, inference_cache=None, attention_mask=None):
        q, c_kv, k_r = self.latents(x, rope)
        if inference_cache is not None:  # the latent cache (megazero.inference.latent_cache)
            if not hasattr(inference_cache, "update_latent"):
                raise ValueError("multi-latent attention generates with megazero.inference.latent_cache.LatentCache "
                                 "(it caches the compressed latent, not K/V)")
            c_all, k_r = inference_cache.update_latent(self.layer_number, c_kv.transpose(0, 1), k_r[:, 0])
            if inference_cache.absorbs():
                ctx = self.absorbed_attention(q, inference_cache)
            else:
                k, v = self.expand(c_all.transpose(0, 1), k_r.unsqueeze(1))
                ctx = inference_cache.attend(self.prescaled(q), k, v)
        else:
            k, v = self.expand(c_kv, k_r)
            if self.cp > 1:
                if attention_mask is not None:
                    raise ValueError("--reset-attention-mask is not supported with context parallelism")
                ctx = self.context_parallel_attention(q, k, v)
            elif self.config.recompute_granularity == "selective" and self.training:
                ctx = checkpoint(self.core_attention, self.tracker, q, k, v, attention_mask)
            else:
                ctx = self.core_attention(q, k, v, attention_mask)
        s, b = ctx.shape[2], ctx.shape[0]
        return self.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d_v))
