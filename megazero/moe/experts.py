"""A routed expert: its weights split over the expert-TP group (ETP), its MLP.

Expert ``e`` of layer ``n`` computes ``fc2(act(fc1 x))`` with ``fc1.weight`` ``[2f, h]`` (SwiGLU:
gate and up blocks) or ``[f, h]``, and ``fc2.weight`` ``[h, f]``. Over ETP ranks ``fc1`` keeps a
block of output rows (of each logical block) and ``fc2`` a block of input columns, the rule of
:mod:`megazero.tensor_parallel.spec`; the output is this rank's partial sum over ETP, which the
dispatcher reduce-scatters (:mod:`megazero.moe.dispatch`). No collective here. The weight
gradients defer to a zero-bubble schedule's ``W`` like the dense linears'
(:mod:`megazero.tensor_parallel.weight_grad_store`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megazero.tensor_parallel import seeded_normal
from megazero.tensor_parallel.activations import activate
from megazero.tensor_parallel.layers import TPLayer
from megazero.tensor_parallel.wgrad_fusion import linear


class ExpertLinear(TPLayer):
    """``Y = X W^T`` for one routed expert, ``W`` (``[out, in]``) split over the expert-TP
    group along ``dim`` (0: output rows in logical blocks ``partition_sizes``, as a column-parallel
    linear; 1: input columns, as a row-parallel one) by :mod:`.spec`'s rule. No collective: the
    dispatcher gathers the tokens before and reduce-scatters the partial outputs after."""

    expert_parallel = True  # its parameter belongs to one EP rank, reduced over expert-DP

    def __init__(self, in_features: int, out_features: int, etp_group, *, dim: int, partition_sizes=None,
                 init_method=None, params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = etp_group
        self.partitions = {"weight": (dim, partition_sizes if dim == 0 else None, None)}
        self.param_inits = {}
        self.weight_grad_store = None  # split backward: WeightGradStore.attach (deferred to W)
        shape = (out_features, in_features)

        def full() -> torch.Tensor:
            w = torch.empty(shape, dtype=torch.float32)
            init_method(w)
            return w
        self.weight = self._make("weight", shape, full, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, None, self.weight_grad_store)


class ExpertMLP(nn.Module):
    """Routed expert ``e`` of layer ``n``: ``fc2(act(fc1 x))``, weights split over expert TP
    (fc1's rows, in gate/up blocks for SwiGLU; fc2's columns): its output is this rank's
    partial sum over the expert-TP group."""

    def __init__(self, config, layer_number: int, expert: int, etp_group, device):
        super().__init__()
        f, h, std, seed = config.moe.ffn_hidden_size, config.hidden_size, config.init_method_std, config.seed
        key, self.swiglu = f"layers.{layer_number}.mlp.experts.{expert}", config.activation == "swiglu"
        self.activation = config.activation
        self.fc1 = ExpertLinear(h, 2 * f if self.swiglu else f, etp_group, dim=0,
                                partition_sizes=[f, f] if self.swiglu else None,
                                init_method=seeded_normal(std, seed, f"{key}.fc1.weight"),
                                params_dtype=config.params_dtype, device=device)
        self.fc2 = ExpertLinear(f, h, etp_group, dim=1,
                                init_method=seeded_normal(std / math.sqrt(2 * config.num_layers), seed,
                                                          f"{key}.fc2.weight"),
                                params_dtype=config.params_dtype, device=device)

    def forward(self, x):
        return self.fc2(activate(self.fc1(x), self.activation))
