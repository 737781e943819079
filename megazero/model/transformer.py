"""One pre-norm transformer layer built from tensor-parallel pieces.

``x`` is ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism). Per layer::

    x = x + dropout(Attention(Norm(x)))        # QKV column-parallel, dense row-parallel
    x = x + dropout(MLP(Norm(x)))              # fc1 column-parallel, fc2 row-parallel

Each TP region costs one ``f``/``g`` pair: without SP an all-reduce in forward (``g`` after the
row-parallel linear) and one in backward (``f`` before the column-parallel linear); with SP an
all-gather + reduce-scatter pair in each direction instead (same volume, activations between
regions stored ``1/p`` as large).

Attention is :mod:`.attention`'s (RoPE, GQA, the context-parallel paths) or, with
``multi_latent_attention``, :mod:`.mla`'s, the MLP :mod:`.mlp`'s,
an MoE block :mod:`megazero.moe.layer`'s.

Sequence parallelism: a norm's parameters are replicated while its input is split along the
sequence, so each rank's gradient is partial; they pass through ``f`` (identity forward,
all-reduce backward) so the gradient that reaches the parameter is already the TP sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.moe.layer import MoELayer
from megazero.tensor_parallel import copy_to_tp_region, dropout
from megazero.tensor_parallel.mappings import group_size
from megazero.tensor_parallel.random import REPLICATED, TENSOR_PARALLEL

from .attention import Attention
from .config import GPTConfig
from .mla import MultiLatentAttention
from .mlp import MLP


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
        attention = MultiLatentAttention if config.multi_latent_attention else Attention  # MLA: model/mla.py
        self.attention = attention(config, layer_number, tp_group, tracker, device, topo)
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
