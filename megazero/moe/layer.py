"""The Mixture-of-Experts block that replaces a layer's MLP (``GPTConfig.moe``).

``MoELayer(x)`` for the ``[s, b, h]`` (``[s/p, b, h]`` under SP) input of the MLP::

    probs, map = Router(x)                                    # megazero.moe.router
    y = dispatch(x, probs, map, experts)                      # megazero.moe.dispatch
    y = y + sigmoid(x g^T) * Shared(x)                        # shared expert (gate optional)

Parameters, under global names like every other weight (drawn whole from (seed, name)):
``layers.N.mlp.router.weight`` ``[E, h]``; routed expert ``e``:
``layers.N.mlp.experts.e.fc1.weight`` ``[2f, h]`` (SwiGLU gate; up) or ``[f, h]`` and
``layers.N.mlp.experts.e.fc2.weight`` ``[h, f]`` -- held only by the EP rank owning ``e``
(experts ``[r E/EP, (r+1) E/EP)`` on EP rank ``r``), split over the expert-TP group
(:class:`~megazero.moe.experts.ExpertLinear`); the shared expert
``layers.N.mlp.shared_expert.fc1/fc2.weight`` (an MLP of ``shared_expert_intermediate_size``
over TP) and ``layers.N.mlp.shared_expert_gate.weight`` ``[1, h]``. With ``--moe-grouped-gemm``
the experts run the same path: one matmul pair per local expert on its contiguous rows.

Tokens replicated over TP (TP > 1 without SP: inference only; training refuses it as Megatron)
are split over TP here -- padded to a multiple of TP -- and the outputs all-gathered, so each
(token, expert) pair is computed once.

:class:`MoEState` is the per-model object the routers share: the aux-loss gradient scale of the
current step, the per-layer metric sums, and the expert-bias update.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from megazero.tensor_parallel import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region, seeded_normal)
from megazero.tensor_parallel.mappings import group_size

from .dispatch import allgather_dispatch, alltoall_dispatch
from .experts import ExpertMLP
from .router import Router

class MoEState:
    """Shared by the routers of one rank's model chunks: ``aux_scale`` (the gradient every aux
    loss gets, the schedule's ``grad_scale / M``), ``sums[name][n]`` (the metric of global layer
    ``n`` summed over this step's micro-batches, this rank's share), the routers (for the
    expert-bias update)."""

    def __init__(self, num_layers: int, device, num_experts: int = 0, expert_bias: bool = False, cp: int = 1):
        self.num_layers, self.device, self.cp = num_layers, torch.device(device), cp
        self.num_experts, self.expert_bias = num_experts, expert_bias
        self.aux_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.sums: dict[str, torch.Tensor] = {}
        self.routers: list[Router] = []
        self.trackers: list = []  # the chunks' RNG trackers: recomputing() reads their flag

    def recomputing(self) -> bool:
        """Whether a checkpointed forward is being replayed in backward (no metrics, counts or
        aux-loss attachments twice: the original forward's are the ones backward runs)."""
        return any(t.recomputing for t in self.trackers)

    def set_aux_scale(self, scale) -> None:
        """Set the aux losses' backward scale (a device fill: no host read of ``scale``), times CP:
        each CP rank attaches its piece of the sequence's aux loss and gradients are averaged over
        DP x CP, so the pieces must weigh CP each to sum to the one-process loss (as the LM loss,
        whose CP ranks return ``CP x`` their share)."""
        value = scale if torch.is_tensor(scale) else torch.tensor(float(scale))
        self.aux_scale.copy_(value * self.cp)

    def record(self, name: str, layer: int, value: torch.Tensor) -> None:
        if name not in self.sums:
            self.sums[name] = torch.zeros(self.num_layers, dtype=torch.float32, device=self.device)
        self.sums[name][layer] += value.float()

    def take(self) -> dict[str, torch.Tensor]:
        """This step's metric sums (then zeroed)."""
        out = {name: v.clone() for name, v in self.sums.items()}
        for v in self.sums.values():
            v.zero_()
        return out

    def discard(self) -> None:
        """Forget this step's metric sums and routed-token counts (the step is run again)."""
        self.take()
        for r in self.routers:
            if r.expert_bias is not None:
                r.tokens_per_expert.zero_()

    @torch.no_grad()
    def update_expert_bias(self, rate: float, group=None) -> None:
        """``bias += rate * sign(mean_e c_e - c_e)`` with ``c`` the step's routed counts summed
        over ``group`` (every rank of the stage; None: the world, each stage filling its own
        layers' rows), then the counts restart. Runs once per step, skipped or not (Megatron's
        ``_update_router_expert_bias`` in ``finalize_model_grads``)."""
        if not self.expert_bias:  # decided by the config: every rank joins the sum, MoE layers or not
            return
        routers = [r for r in self.routers if r.expert_bias is not None]
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float32, device=self.device)
        for r in routers:
            counts[r.layer_number] = r.tokens_per_expert
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        for r in routers:
            c = counts[r.layer_number]
            r.expert_bias += rate * torch.sign(c.mean() - c)
            r.tokens_per_expert.zero_()


class SharedExpertGate(nn.Module):
    """``w_g`` (``[1, h]``, replicated): the shared expert is scaled by ``sigmoid(x w_g^T)``."""

    def __init__(self, config, layer_number: int, device):
        super().__init__()
        shape, name = (1, config.hidden_size), f"layers.{layer_number}.mlp.shared_expert_gate.weight"

        def full() -> torch.Tensor:
            w = torch.empty(shape)
            seeded_normal(config.init_method_std, config.seed, name)(w)
            return w
        self.param_inits = {"weight": full}
        meta = torch.device(device).type == "meta"
        value = torch.empty(shape, device="meta") if meta else full().to(device)
        self.weight = nn.Parameter(value.to(config.params_dtype))


class MoELayer(nn.Module):
    """See the module doc. ``forward(x) -> (y, None)`` like the dense MLP (no output bias)."""

    def __init__(self, config, layer_number: int, topo, tracker, state: MoEState, device, buffer_device,
                 shared_expert: nn.Module | None = None):
        """``shared_expert``: the model's dense MLP of ``shared_expert_intermediate_size`` over TP,
        built by the model (its ``forward(x) -> (y, bias)``); required when the config has one."""
        super().__init__()
        moe = config.moe
        self.moe, self.layer_number = moe, layer_number
        self.tp_group = topo.tp_group if topo is not None else None
        self.sequence_parallel = config.sequence_parallel and group_size(self.tp_group) > 1
        self.ep_group = topo.expert_group("ep") if topo is not None else None
        self.etp_group = topo.expert_group("etp") if topo is not None else None
        self.tp_ep_group = topo.expert_group("tp_ep") if topo is not None else None
        ep, ep_rank = (topo.ep, topo.ep_rank) if topo is not None else (1, 0)
        if moe.num_experts % ep:
            raise ValueError(f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        per = moe.num_experts // ep
        self.local = (ep_rank * per, (ep_rank + 1) * per)
        token_group = topo.group("tp_cp") if topo is not None and topo.cp > 1 else None
        self.router = Router(config, layer_number, self.tp_group, state, device, buffer_device, token_group)
        state.routers.append(self.router)
        if tracker is not None and tracker not in state.trackers:
            state.trackers.append(tracker)
        self.experts = nn.ModuleDict({str(e): ExpertMLP(config, layer_number, e, self.etp_group, device)
                                      for e in range(*self.local)})
        self.shared_expert = self.shared_expert_gate = None
        if bool(moe.shared_expert_intermediate_size) != (shared_expert is not None):
            raise ValueError(f"layer {layer_number}: the config's shared expert size is "
                             f"{moe.shared_expert_intermediate_size} but shared_expert is {shared_expert!r}")
        if shared_expert is not None:
            self.shared_expert = shared_expert
            if moe.shared_expert_gate:
                self.shared_expert_gate = SharedExpertGate(config, layer_number, device)
        self.stats: dict = {}

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on rows grouped by local expert (``counts[i]`` rows for the i-th)."""
        pieces = rows.split(counts)
        return torch.cat([mlp(piece) for mlp, piece in zip(self.experts.values(), pieces)])

    def _routed(self, x2d: torch.Tensor, seq_shape) -> torch.Tensor:
        probs, routing_map = self.router(x2d, seq_shape)
        if self.moe.token_dispatcher == "allgather":
            return allgather_dispatch(x2d, probs, routing_map, self.run_experts, self.tp_ep_group, self.local,
                                      self.stats)
        return alltoall_dispatch(x2d, probs, routing_map, self.run_experts, self.ep_group, self.etp_group,
                                 self.stats)

    def forward(self, x: torch.Tensor):
        s, b, h = x.shape
        replicated = group_size(self.tp_group) > 1 and not self.sequence_parallel
        if replicated:  # every TP rank holds all tokens: each routes its share once
            tokens = x.reshape(s * b, h)
            pad = (-tokens.shape[0]) % group_size(self.tp_group)
            tokens = torch.cat([tokens, tokens.new_zeros(pad, h)]) if pad else tokens
            part = scatter_to_sequence_parallel_region(tokens, self.tp_group)
            out = self._routed(part, (part.shape[0], 1))
            y = gather_from_sequence_parallel_region(out, self.tp_group, grad_is_partial=False)[:s * b]
            y = y.reshape(s, b, h)
        else:
            y = self._routed(x.reshape(s * b, h), (s, b)).reshape(s, b, h)
        if self.shared_expert is not None:
            shared, _ = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                g = self.shared_expert_gate.weight
                g = copy_to_tp_region(g, self.tp_group) if self.sequence_parallel else g
                shared = shared * torch.sigmoid(F.linear(x, g))
            y = y + shared
        return y, None
