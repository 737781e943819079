"""Adam / AdamW on flat fp32 shards with ``torch._foreach_*`` kernels (torch.optim's math).

For step t (1-based), gradient g, weight decay wd applied to matrices only (the *decay
segments*: parameters with dim >= 2, Megatron's parameter groups)::

    decoupled (AdamW, default):   p <- p * (1 - lr * wd)          before the moments
    L2 (Adam, decoupled=False):   g <- g + wd * p                  before the moments
    m <- m + (1 - b1) (g - m)                  (lerp, as torch's foreach path)
    v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

``decoupled=True`` is ``torch.optim.AdamW`` (and DeepSpeed's Adam/AdamW with ``adam_w_mode``
true); ``decoupled=False`` is ``torch.optim.Adam(weight_decay=wd)`` (DeepSpeed's Adam with
``adam_w_mode`` false): the decay term enters m and v. Everything here is elementwise on this
rank's shard: no communication.
"""

from __future__ import annotations

import math

import torch


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, decay_views, *, step: int, lr: float,
               betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool = True,
               decay_grads=None) -> None:
    """One Adam(W) update of lists of flat fp32 tensors (in place).

    ``decay_views``: views of ``params`` that take weight decay. With ``decoupled=False``,
    ``decay_grads`` must hold the matching views of ``grads`` (same order and sizes); they are
    modified in place (``g += wd * p``).
    """
    if not params:
        return
    b1, b2 = betas
    if weight_decay and decay_views:
        if decoupled:
            torch._foreach_mul_(decay_views, 1.0 - lr * weight_decay)
        else:
            if decay_grads is None or len(decay_grads) != len(decay_views):
                raise ValueError("adamw_step(decoupled=False) needs decay_grads matching decay_views")
            torch._foreach_add_(decay_grads, decay_views, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - b2)
    step_size = lr / (1.0 - b1 ** step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1.0 - b2 ** step))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def sum_of_squares(views, device=None) -> torch.Tensor:
    """Sum of squares of a list of fp32 tensors, as one fp32 scalar tensor (no host sync)."""
    if not views:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(views)
    return torch.stack(norms).square().sum()
