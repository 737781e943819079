"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers D``).

Follows megatron-core 0.16.1 ``transformer/multi_token_prediction.py``
(``MultiTokenPredictionLayer``, ``MultiTokenPredictionBlock``) and ``models/gpt/gpt_model.py``
``_postprocess``. With ``h_0`` the main model's output after its final norm (``[s, b, h]``, the
hidden states the main logits come from), ``t`` the input tokens and ``roll(x)`` the shift of a
``[b, s]`` tensor one position to the left with a 0 in the last position (Megatron's
``roll_tensor`` at CP 1), depth ``k = 1..D`` computes::

    t_k    = roll^k(t)
    e_k    = Emb(t_k)                                             # the shared embedding (and its dropout)
    x_k    = W_k [enorm_k(e_k); hnorm_k(h_{k-1})]                 # eh_proj, W_k [h, 2h]: embedding first
    h_k    = final_norm_k(Layer_k(x_k))                           # one transformer layer, the same RoPE
    L_k    = sum_i m_k[i] CE(Out(h_k)[i], roll^k(y)[i]) / sum_i m_k[i],   m_k = roll^k(loss_mask)

with ``y`` the labels (``t`` shifted by one) and ``Out`` the shared output head, so depth ``k``
predicts token ``t_{i+k+1}`` at position ``i``. The gradient of ``(c / D) sum_k L_k`` (``c`` =
``--mtp-loss-scaling-factor``) joins the LM loss's through
:class:`~megazero.moe.router.AttachLoss` (Megatron's ``MTPLossAutoScaler``: the same backward
scale as the LM loss, ``grad_scale / M``); the returned LM loss does not include it. Each
``L_k`` is recorded as ``mtp_loss`` of depth ``k`` (over TP: each TP rank a ``1/TP`` share) for
the log line and TensorBoard (``mtp_1 loss``, ..., Megatron's ``MTPLossLoggingHelper``).

Layer ``k``'s transformer layer is global layer ``num_layers + k - 1`` (its weights are drawn
from that name; an MoE block when the last decoder layer is one, as Megatron builds the MTP
layer from the decoder's last layer spec). Under TP ``eh_proj`` is column-parallel (its output
all-gathered, then scattered over the sequence with SP), the norms replicated.

Full activation recompute (``--recompute-granularity full``, training), as megatron-core 0.16.1's
``MultiTokenPredictionLayer.forward`` / ``_checkpointed_forward``: with ``--recompute-method
uniform`` (here also with no method, the decoder's uniform default) the part ``x_k -> Layer_k(x_k)``
(``enorm``, ``hnorm``, the concatenation, ``eh_proj`` with its TP gather / SP scatter, the
transformer layer: Megatron's ``_proj_and_transformer_layer``) keeps only its inputs ``h_{k-1}``,
``e_k`` and the RoPE tables and is recomputed in backward with the forward's dropout masks
(:func:`~megazero.tensor_parallel.checkpoint` with the chunk's RNG tracker, as the decoder
layers); the embedding ``e_k`` (and its dropout), ``final_norm_k``, the output head and the loss
stay outside, stored. Megatron asserts ``recompute_num_layers == 1`` there: a uniform recompute
of more layers with MTP is refused (``--mtp-num-layers`` check and :class:`MultiTokenPrediction`).
``--recompute-method block``: the MTP layers are not recomputed; the flag check warns
(:data:`MTP_BLOCK_NOTICE`, one ``WARNING`` line per job), where Megatron warns "not supported for
MTP yet. Skipping recompute" in the forward.

Parameters (``mtp.layers.{k-1}.``): ``enorm``, ``hnorm``, ``eh_proj`` (``[h, 2h]``),
``transformer_layer.*``, ``final_norm``. A pipeline's last stage without the embedding holds a
copy ``mtp.embedding.*`` of it, drawn from the same seed and kept equal by summing its gradient
with the first stage's over the embedding group (:func:`megazero.model.stages.shared_embedding_params`).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.moe.router import AttachLoss
from megazero.tensor_parallel import (ColumnParallelLinear, checkpoint, scatter_to_sequence_parallel_region,
                                      seeded_normal)
from megazero.tensor_parallel.mappings import group_size

from .transformer import Norm, TransformerLayer

MTP_EMBEDDING = "mtp.embedding.word_embeddings.weight"


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` shifted one position to the left, 0 in the last (Megatron's ``roll_tensor``)."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


MTP_BLOCK_NOTICE = ("--recompute-method block: the multi-token prediction layers are not recomputed (as "
                    "megatron-core 0.16.1: 'not supported for MTP yet. Skipping recompute')")


def recompute_mtp(config) -> bool:
    """Whether a training forward recomputes the MTP layers (the module doc): full granularity with
    the uniform method (or none) of one layer; ``ValueError`` for more layers (megatron-core 0.16.1
    asserts ``recompute_num_layers == 1``), False for the block method."""
    if config.recompute_granularity != "full" or not config.mtp_num_layers:
        return False
    if config.recompute_method == "block":
        return False  # the flag check warns (MTP_BLOCK_NOTICE), once per job
    n = config.recompute_num_layers
    if n not in (None, 1):
        raise ValueError(mtp_recompute_problem(config.mtp_num_layers, config.recompute_method, n))
    return True


def mtp_recompute_problem(mtp_num_layers, method, num_layers) -> str:
    """The one line refusing a uniform full recompute of ``num_layers`` > 1 with MTP."""
    given = f"--recompute-method {method}" if method else "--recompute-granularity full"
    return (f"--mtp-num-layers {mtp_num_layers} with {given} --recompute-num-layers {num_layers}: megatron-core "
            "0.16.1 recomputes each MTP layer on its own (it asserts recompute_num_layers == 1); use "
            "--recompute-num-layers 1, or --recompute-method block (the MTP layers then are not recomputed)")


class MTPLayer(nn.Module):
    """Depth ``depth + 1`` (0-based ``depth``): see the module doc."""

    def __init__(self, config, depth: int, tp_group, tracker, device, topo=None, moe_state=None, buffer_device=None):
        super().__init__()
        self.tp_group, self.tracker = tp_group, tracker  # the chunk's dropout RNG: replayed by a recompute
        self.sp = config.sequence_parallel and group_size(tp_group) > 1
        h = config.hidden_size
        self.enorm = Norm(config, tp_group, self.sp, device)
        self.hnorm = Norm(config, tp_group, self.sp, device)
        self.eh_proj = ColumnParallelLinear(
            2 * h, h, tp_group, bias=False, gather_output=True, sequence_parallel=self.sp,
            init_method=seeded_normal(config.init_method_std, config.seed, f"mtp.layers.{depth}.eh_proj.weight"),
            params_dtype=config.params_dtype, device=device)
        self.transformer_layer = TransformerLayer(config, config.num_layers + depth, tp_group, tracker, device, topo,
                                                  moe_state, buffer_device)
        self.final_norm = Norm(config, tp_group, self.sp, device)

    def forward(self, hidden, embedded, rope, attention_mask=None, recompute: bool = False):
        """``h_k = final_norm_k(Layer_k(x_k))``; ``recompute``: ``x_k -> Layer_k(x_k)`` under
        :func:`~megazero.tensor_parallel.checkpoint` (the module doc), ``final_norm_k`` outside."""
        def run(h, e, *cos_sin):
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))  # [s, b, h]
            if self.sp:
                x = scatter_to_sequence_parallel_region(x, self.tp_group)
            return self.transformer_layer(x, cos_sin if cos_sin else None, attention_mask=attention_mask)
        args = (hidden, embedded) + (tuple(rope) if rope is not None else ())
        return self.final_norm(checkpoint(run, self.tracker, *args) if recompute else run(*args))


class MultiTokenPrediction(nn.Module):
    """The ``D`` MTP layers of a GPT's last stage (and, when that stage lacks it, the embedding
    copy ``embedding``); :meth:`loss` attaches ``(c / D) sum_k L_k`` to the LM losses."""

    def __init__(self, config, tp_group, tracker, device, topo=None, moe_state=None, buffer_device=None,
                 embedding: nn.Module | None = None):
        super().__init__()
        if embedding is not None and config.tied_embeddings:
            raise ValueError("multi-token prediction on a last pipeline stage without the embedding needs "
                             "--untie-embeddings-and-output-weights")
        self.config, self.tp_group, self.moe_state = config, tp_group, moe_state
        self.recompute = recompute_mtp(config)
        self.layers = nn.ModuleList([MTPLayer(config, d, tp_group, tracker, device, topo, moe_state, buffer_device)
                                     for d in range(config.mtp_num_layers)])
        self.embedding = embedding  # a copy of the word embedding (None: the chunk's own is used)

    def loss(self, lm_losses, hidden, tokens, position_ids, rope, attention_mask, labels, loss_mask,
             embedding, logits_of, cross_entropy):
        """``lm_losses`` ([b, s]) with the MTP losses attached (unchanged values). ``hidden``: the
        normed main output; ``embedding(ids, positions)``; ``logits_of(h)``; ``cross_entropy(logits,
        labels [b, s]) -> [b, s]``."""
        c, D = self.config.mtp_loss_scaling_factor, self.config.mtp_num_layers
        record = self.training and torch.is_grad_enabled() and not self.moe_state.recomputing()
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        total = None
        for k, layer in enumerate(self.layers):
            tokens, labels, mask = roll_left(tokens), roll_left(labels), roll_left(mask)
            hidden = layer(hidden, embedding(tokens, position_ids), rope, attention_mask,
                           recompute=self.recompute and self.training)
            losses = cross_entropy(logits_of(hidden), labels)
            depth_loss = (losses * mask).sum() / mask.sum()
            if record:
                self.moe_state.record("mtp_loss", k, depth_loss.detach() / group_size(self.tp_group))
            total = depth_loss if total is None else total + depth_loss
        return AttachLoss.apply(lm_losses, total * (c / D), self.moe_state)
