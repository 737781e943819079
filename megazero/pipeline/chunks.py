"""The gradient sum of parameters shared by pipeline stages.

The layout math of chunks (:func:`megazero.parallel.layout.chunk_layer_ranges`,
:func:`~megazero.parallel.layout.chunk_roles`): with ``PP`` pipeline ranks and ``VP`` chunks per rank there are ``S = PP * VP`` virtual stages;
the ``L`` layers are split evenly, ``L / S`` consecutive layers per virtual stage, and chunk
``c`` of pipeline rank ``r`` is virtual stage ``s = c * PP + r`` (Megatron's interleaved order:
PP = 2, VP = 2, 8 layers -> rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7).  The
input side (e.g. an embedding) lives on virtual stage 0 (chunk 0 of pipeline rank 0), the output
side and the loss on virtual stage ``S - 1`` (the last chunk of the last pipeline rank).

Shared parameters (e.g. a tied input/output matrix with PP > 1): each of the stages holding a copy
passes ``(param, group)``; :func:`allreduce_shared_grads` sums the copies' gradients over the group
-- volume ``numel`` per rank, all-reduce -- so the copies take the same optimizer step.  (A ZeRO
optimizer given the same list as ``shared_params`` does this itself.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce_shared_grads(shared_params) -> None:
    """Sum each shared copy's ``.grad`` over its group (``shared_params``: ``[(param, group)]``,
    the same order on every member).  Call after the schedule, before the optimizer, when no ZeRO
    optimizer manages the sync; a copy that received no gradient contributes zeros."""
    for param, group in shared_params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)
