"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Rank ``r`` of ``p`` holds logits ``z[..., v]`` for ``v`` in its contiguous range of the padded
vocabulary ``V'``; only the first ``K = vocab_size`` entries are real. In fp32, per token:

1. ``m = max_v z_v``                    -- local max, all-reduce(MAX) over the TP group
2. ``e_v = exp(z_v - m)`` with padded entries ``v >= K`` set to 0 (they get no mass),
   ``S = sum_v e_v``; ``t = z_y - m`` from the rank owning label ``y`` (0 elsewhere);
   with label smoothing also ``Z = sum_{v<K} (z_v - m)``; all three summed in one all-reduce
3. ``loss = log S - t`` and with smoothing ``eps``:
   ``loss = (1 - eps)(log S - t) + eps (log S - Z / K)``  (== ``F.cross_entropy(label_smoothing=eps)``)

One ``[tokens, V'/p]`` fp32 buffer holds ``z - m``, then ``e``, then the saved softmax, each step in
place as in megatron-core 0.16.1's ``VocabParallelCrossEntropy``
(megatron/core/tensor_parallel/cross_entropy.py), which writes into its input logits; here the
input is never written (fp32 logits get one new buffer for ``z - m``).

Backward (no communication): ``dz_v = g * (softmax_v - (1 - eps) [v == y] - eps / K)`` on real
entries and 0 on padded ones. Labels equal to ``ignore_index`` give loss 0 and no gradient.
Communication: a ``[tokens]`` all-reduce(MAX) and a ``[tokens, 2 or 3]`` all-reduce(SUM),
versus ``(p-1)/p * tokens * V'`` to gather the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, label_smoothing, ignore_index):
        p, rank = group_size(group), group_rank(group)
        z = logits.float()  # the logits themselves in fp32: never written below
        per_rank = z.shape[-1]
        start = rank * per_rank
        real = torch.arange(start, start + per_rank, device=z.device) < vocab_size  # [V'/p]
        if start + per_rank > vocab_size:  # padded entries here (known on the host): mask them; else no copy
            z = z.masked_fill(~real, float("-inf"))
        m = torch.amax(z, dim=-1)  # the values of max(dim) without its indices
        if p > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # from here z is a buffer of our own: a copy already (bf16 cast, padding mask) or made now
        z = z - m.unsqueeze(-1) if z is logits else z.sub_(m.unsqueeze(-1))
        ignored = labels == ignore_index
        local_label = labels - start
        mine = (local_label >= 0) & (local_label < per_rank) & ~ignored
        idx = local_label.masked_fill(~mine, 0)
        target = torch.gather(z, -1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        smooth = z.masked_fill(~real, 0.0).sum(dim=-1) if label_smoothing > 0 else None  # Z, before z is overwritten
        exp = torch.exp(z, out=z)  # in place (z is ours; t and Z are read): padded entries exp(-inf) = 0
        sums = [exp.sum(dim=-1), target] + ([smooth] if smooth is not None else [])
        stacked = torch.stack(sums, dim=-1)
        if p > 1:
            dist.all_reduce(stacked, group=group)
        log_s = stacked[..., 0].log()
        loss = log_s - stacked[..., 1]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_s - stacked[..., 2] / vocab_size)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(stacked[..., 0].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, ignored, real)
        ctx.label_smoothing, ctx.vocab_size, ctx.in_dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored, real = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # saved buffer, reused in place (backward runs once)
        onehot = mine.to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -onehot.unsqueeze(-1))
        if eps > 0:
            grad.sub_(real.to(grad.dtype) * (eps / ctx.vocab_size))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_size: int | None = None,
                                 label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32, ``labels.shape``) of logits ``[..., V'/p]`` split over ``group``.

    ``vocab_size``: the real vocabulary ``K`` (default: all of ``V'``); entries ``>= K`` are padding.
    """
    p = group_size(group)
    padded = logits.shape[-1] * p
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} outside (0, {padded}]")
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size, float(label_smoothing), ignore_index)
