"""The MLP nonlinearity on a column-parallel ``fc1`` output, shared by the dense MLP and the experts.

``fc1`` of a SwiGLU MLP holds two logical blocks ``[gate; up]`` (``partition_sizes=[f, f]``); the
one TP rule (:mod:`.spec`) splits each block over the ranks, so a rank's local output is
``[gate_r; up_r]`` and ``silu(gate_r) * up_r`` is exactly its slice of ``silu(gate) * up``: the
activation needs no communication at any TP (or expert-TP) size. GELU is elementwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output: ``silu(gate) * up`` for SwiGLU (``y = [gate; up]``
    on the last dim), exact or tanh GELU otherwise."""
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
