"""The MoE router: scores, top-k, capacity, and the load-balancing losses, as Megatron-core.

Follows core_v0.20.0 ``megatron/core/transformer/moe/router.py`` (``TopKRouter``) and
``moe_utils.py``; ``T`` tokens of this rank, ``E`` experts, top ``k``:

* **logits** ``L = x W_r^T`` (``[T, E]``; in fp32/fp64 with ``router_dtype``). ``W_r`` is
  replicated; under sequence parallelism the tokens are split over TP, so its gradient passes
  ``f`` and is the TP sum (as the norms).
* **z-loss** (``z_loss_coeff``): ``c / TP * mean_t(logsumexp(L_t)^2)`` per rank (the TP sum is the
  mean over the sequence), attached to ``L``; the metric ``z_loss`` is ``mean(lse^2)``.
* **routing** (:func:`route`): see :mod:`.moe_config`; dropping (:func:`drop_over_capacity`).
* **aux loss** (``aux_loss``): ``c E / (k N^2) * sum_e f_e P_e`` with ``f_e`` the tokens sent to
  expert ``e`` by the un-dropped top-k of the *whole sequence* (counts summed over TP, no grad),
  ``P_e = sum_t s_te`` this rank's scores (softmax over all experts, or normalized sigmoids) and
  ``N = T * TP``: per-rank pieces that sum over TP to the single-process value (over TP x CP,
  the ranks holding one sequence, under context parallelism).
  ``seq_aux_loss`` does the same per sequence of the micro-batch and averages over the ``b``
  sequences. Metrics ``load_balancing_loss`` / ``seq_load_balancing_loss``: the loss over ``c``.
* The losses reach the gradient, not ``lm loss``: :class:`AttachLoss` returns its input
  unchanged and in backward adds ``d(loss) = state.aux_scale`` (the schedule's
  ``grad_scale / M``, set by :meth:`MoEState.set_aux_scale`), Megatron's
  ``MoEAuxLossAutoScaler``. The optimizer then averages over DP as for the LM loss.
* **expert bias** (sigmoid, ``enable_expert_bias``): the routed counts of each step accumulate in
  ``tokens_per_expert``; :meth:`MoEState.update_expert_bias` sums them over the stage's ranks and
  moves ``bias += rate * sign(mean - count)`` once per step (``get_updated_expert_bias``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.tensor_parallel import copy_to_tp_region, seeded_normal
from megazero.tensor_parallel.mappings import group_size, reduce_from_tp_region

from .config import MoEConfig

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class AttachLoss(torch.autograd.Function):
    """``forward(x, loss, state) = x``; backward adds ``state.aux_scale`` as ``loss``'s gradient."""

    @staticmethod
    def forward(ctx, x, loss, state):
        ctx.state = state
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, g):
        (loss,) = ctx.saved_tensors
        return g, torch.ones_like(loss) * ctx.state.aux_scale.to(loss.dtype), None


def route(logits: torch.Tensor, moe: MoEConfig, expert_bias: torch.Tensor | None):
    """``(probs [T, E] zero off the top-k, routing_map [T, E] bool)`` from fp logits (see
    :mod:`.moe_config`). Scores are fp32 (or the logits' wider dtype); probs return in the logits' dtype."""
    T, E = logits.shape
    k = moe.router_topk
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32

    def topk(scores):
        if moe.group_topk:
            groups = scores.view(T, moe.num_groups, -1).topk(k // moe.group_topk, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(groups).scatter(1, groups.topk(moe.group_topk, dim=-1)[1], 1).bool()
            scores = scores.masked_fill(~keep.repeat_interleave(E // moe.num_groups, dim=1), float("-inf"))
        return torch.topk(scores, k=k, dim=1)

    if moe.score_function == "softmax":
        if moe.pre_softmax:
            probs, idx = topk(torch.softmax(logits, dim=-1, dtype=work))
        else:
            top, idx = topk(logits)
            probs = torch.softmax(top, dim=-1, dtype=work)
    else:
        scores = torch.sigmoid(logits.to(work))
        if expert_bias is not None:
            _, idx = topk(scores + expert_bias.to(work))
            top = torch.gather(scores, 1, idx)
        else:
            top, idx = topk(scores)
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else top
    if moe.topk_scaling_factor:
        probs = probs * moe.topk_scaling_factor
    probs = probs.to(logits.dtype)
    dense = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, idx, 1).bool()
    return dense, routing_map


def drop_over_capacity(probs, routing_map, moe: MoEConfig):
    """Megatron's ``apply_router_token_dropping``: capacity ``C = ceil(T k / E * factor)`` per
    expert; each expert keeps the ``C`` tokens of highest weight (``probs``) or the first ``C``
    routed to it in token order (``position``); with ``pad_to_capacity`` every expert computes
    exactly ``C`` rows (the kept tokens plus zero-weight ones). No dropping when ``C > T``."""
    T, E = probs.shape
    capacity = math.ceil(T * moe.router_topk / E * moe.capacity_factor)
    if capacity > T:
        keep = torch.ones_like(routing_map)
    else:  # 'position' ranks earlier tokens first explicitly (Megatron leaves it to topk's tie order)
        order = torch.arange(T, 0, -1, device=probs.device, dtype=torch.float32).unsqueeze(1)
        ranked = probs if moe.token_drop_policy == "probs" else routing_map.float() * order
        _, rows = torch.topk(ranked, k=capacity, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, rows, True)
    final = keep if moe.pad_to_capacity else routing_map & keep
    return probs * final, final


def aux_scores(logits: torch.Tensor, moe: MoEConfig):
    """``(top-k map, scores)`` for the aux losses: the un-dropped top-k of the full softmax (or
    of the normalized sigmoids), Megatron's ``compute_routing_scores_for_aux_loss``."""
    if moe.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    idx = torch.topk(scores, k=moe.router_topk, dim=1)[1]
    return torch.zeros_like(logits, dtype=torch.int32).scatter(1, idx, 1).bool(), scores


def switch_loss(scores, tokens_per_expert, total_tokens: int, moe: MoEConfig, coeff: float):
    """``c E / (k N^2) * sum_e (sum_t s_te) f_e`` (see module doc)."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        moe.num_experts * coeff / (moe.router_topk * total_tokens * total_tokens))


class Router(nn.Module):
    """``W_r`` (``[E, h]``, drawn whole from (seed, name) like every weight) and the routing of
    one MoE layer; ``forward(x [T, h], seq_shape (s_local, b)) -> (probs, routing_map)``.
    ``buffer_device``: where the fp32 ``expert_bias`` lives (the compute device, also when the
    weights are built on the meta device)."""

    def __init__(self, config, layer_number: int, tp_group, state, device, buffer_device, token_group=None):
        super().__init__()
        moe = config.moe
        self.moe, self.layer_number, self.tp_group, self.state = moe, layer_number, tp_group, state
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        # the ranks holding pieces of one sequence: TP under SP, times CP (Megatron's tp_cp group)
        self.token_group = token_group if token_group is not None else (tp_group if self.sequence_parallel else None)
        shape = (moe.num_experts, config.hidden_size)
        init = seeded_normal(config.init_method_std, config.seed, f"layers.{layer_number}.mlp.router.weight")

        def full() -> torch.Tensor:
            w = torch.empty(shape, dtype=torch.float32)
            init(w)
            return w
        self.param_inits = {"weight": full}
        if torch.device(device).type == "meta":
            self.weight = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device="meta"))
        else:
            self.weight = nn.Parameter(full().to(device=device, dtype=config.params_dtype))
        if moe.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32,
                                                            device=buffer_device))
            self.register_buffer("tokens_per_expert", torch.zeros_like(self.expert_bias), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None

    def forward(self, x: torch.Tensor, seq_shape: tuple[int, int]):
        moe = self.moe
        w = copy_to_tp_region(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        dtype = ROUTER_DTYPES[moe.router_dtype] or x.dtype
        logits = F.linear(x.to(dtype), w.to(dtype))
        training = self.training and torch.is_grad_enabled()
        self.once = training and not self.state.recomputing()  # side effects: not again in a recompute
        if training and moe.z_loss_coeff:
            logits = self._z_loss(logits)
        probs, routing_map = route(logits, moe, self.expert_bias)
        if moe.capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, moe)
        if training and any(moe.coeff(t) > 0 for t in ("aux_loss", "seq_aux_loss")):
            probs = self._aux_losses(probs, logits, seq_shape)
        if self.once and self.tokens_per_expert is not None:
            self.tokens_per_expert += routing_map.sum(dim=0).float()
        return probs, routing_map

    def _z_loss(self, logits):
        tp = group_size(self.token_group)
        lse_sq = torch.logsumexp(logits, dim=-1).square().mean()
        if self.once:
            self.state.record("z_loss", self.layer_number, lse_sq.detach() / tp)
        return AttachLoss.apply(logits, lse_sq * (self.moe.z_loss_coeff / tp), self.state)

    def _aux_losses(self, probs, logits, seq_shape):
        moe, tp_group = self.moe, self.token_group
        tp = group_size(tp_group)
        routing_map, scores = aux_scores(logits, moe)
        T = routing_map.shape[0]
        coeff = moe.coeff("aux_loss")
        if coeff > 0:
            counts = reduce_from_tp_region(routing_map.sum(dim=0).float(), tp_group).detach()
            loss = switch_loss(scores, counts, T * tp, moe, coeff)
            if self.once:
                self.state.record("load_balancing_loss", self.layer_number, loss.detach() / coeff)
            probs = AttachLoss.apply(probs, loss, self.state)
        coeff = moe.coeff("seq_aux_loss")
        if coeff > 0:
            s, b = seq_shape
            seq_scores, seq_map = scores.reshape(s, -1), routing_map.reshape(s, -1)
            counts = reduce_from_tp_region(seq_map.sum(dim=0).float(), tp_group).detach()
            loss = switch_loss(seq_scores, counts, s * tp, moe, coeff) / b
            if self.once:
                self.state.record("seq_load_balancing_loss", self.layer_number, loss.detach() / coeff)
            probs = AttachLoss.apply(probs, loss, self.state)
        return probs
