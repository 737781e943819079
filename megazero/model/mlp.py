"""The dense MLP of a GPT layer over tensor parallelism: ``fc2(act(fc1 x))``, ``fc1`` column-parallel
(SwiGLU: logical blocks ``[gate; up]``, each split over TP), ``fc2`` row-parallel; the activation
is :func:`megazero.tensor_parallel.activations.activate`, local to each rank. Also the MoE
shared expert (its own size and parameter names)."""

from __future__ import annotations

import math

from torch import nn

from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, seeded_normal
from megazero.tensor_parallel.activations import activate

from .config import GPTConfig


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
