"""Gradient accumulation fusion: a linear layer (and an embedding) whose weight gradient goes
straight into the optimizer's fp32 flat gradient (Megatron-LM's ``--gradient-accumulation-fusion``).

For ``Y = X W^T + b`` with ``X`` ``[T, in]`` (T = tokens), ``W`` ``[out, in]``, upstream
gradient ``G = dL/dY`` ``[T, out]``, the backward is

* ``dX = G W`` (in the activations' dtype, as ``F.linear``'s backward),
* ``db = sum_T G``,
* ``dW = G^T X``: not returned to autograd; ``sink(W, G, X)`` adds it into the fp32 flat
  gradient that holds ``W``'s gradient (``main_grad += G^T X``, accumulated in fp32), as
  Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication.backward`` does with
  ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, weight.main_grad)``
  (megatron/core/tensor_parallel/layers.py, commit 000c4ac2).

Why: with bf16 weights, an unfused ``dW`` is a bf16 tensor of ``W``'s size that autograd holds
until ``W``'s gradient is complete -- for a tied output layer, until the embedding's lookup
gradient arrives at the very end of the backward -- and that is then added into the fp32 buffer;
on a CPU the bf16 matmul also materializes its fp32 result first. Fused, nothing of ``W``'s size
exists besides the flat gradient itself. Numerically ``dW`` is not rounded to bf16 before it is
accumulated (the fp32 sum Megatron's default computes).

The embedding's backward, ``dW[ids] += G`` (rows of the upstream gradient ``G`` ``[T, h]``
added at the looked-up ids), goes to ``sink(W, ids, G)`` the same way
(:meth:`~megazero.zero.grad_sync.GradientSync.add_embedding_grad`, an ``index_add_`` in fp32).

``sink(W, G, X) -> bool``: the optimizer's
:meth:`~megazero.zero.grad_sync.GradientSync.add_weight_grad`; False (not fused for ``W``):
``dW`` is returned as usual. Returning None for ``W`` keeps ``W``'s other contributions (a tied
embedding's lookup) on autograd's ordinary path; ``W``'s ``AccumulateGrad`` node and its
post-accumulate hook still run once per backward, with ``W.grad`` None when nothing else came.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weight_grad_store import deferring_store


def _linear_wgrad(sink, weight, g2, x2):
    """``dW = G^T X``, or None when ``sink`` took it (gradient accumulation fusion)."""
    if sink is not None and sink(weight, g2, x2):
        return None
    return g2.t().matmul(x2)


def _embedding_wgrad(sink, weight, ids, rows):
    """``dW[ids] += G`` as a dense table, or None when ``sink`` took the rows."""
    if sink is not None and sink(weight, ids, rows):
        return None
    return torch.zeros_like(weight).index_add_(0, ids, rows.to(weight.dtype))


def _anchor(weight: torch.Tensor) -> torch.Tensor:
    """A 0-element leaf that needs a gradient: given to a deferring Function whose other inputs
    need none (a detached table's lookup, a linear of a constant input), so that its output is
    still recorded and its backward -- which pushes ``dW`` -- still runs."""
    return torch.empty(0, dtype=weight.dtype, device=weight.device, requires_grad=True)


class _FusedWgradLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose ``dW`` goes to ``sink`` (module docstring), or, with
    ``deferred = (store, parameter)`` (``weight`` then is the parameter detached), is pushed to the
    :class:`~.weight_grad_store.WeightGradStore` for the schedule's ``W`` (``anchor``: see
    :func:`_anchor`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, sink, deferred):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.has_bias, ctx.deferred = sink, bias is not None, deferred
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_w = None
        if ctx.deferred is not None:
            store, param = ctx.deferred
            store.push(param, lambda sink=ctx.sink: _linear_wgrad(sink, param, g2, x2))
        elif ctx.needs_input_grad[1]:
            grad_w = _linear_wgrad(ctx.sink, weight, g2, x2)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class _FusedWgradEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose ``dW`` (rows ``ids`` += ``G``) goes to ``sink``, or to
    the store (``deferred``, as :class:`_FusedWgradLinear`, with its :func:`_anchor`)."""

    @staticmethod
    def forward(ctx, ids, weight, anchor, sink, deferred):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.weight, ctx.deferred = sink, weight, deferred
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        flat, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.deferred is not None:
            store, param = ctx.deferred
            store.push(param, lambda sink=ctx.sink: _embedding_wgrad(sink, param, flat, rows))
            return None, None, None, None, None
        return None, _embedding_wgrad(ctx.sink, ctx.weight, flat, rows), None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, sink, store=None) -> torch.Tensor:
    """``F.embedding(ids, weight)``; with a ``sink(weight, ids, G)`` and a weight
    that needs its gradient while autograd records, the gradient rows ``dW[ids] += G`` are
    accumulated by the sink in fp32 instead of a dense ``dW`` of the table's size (whose bf16
    copy, and on a CPU its fp32 intermediate, is what the fusion avoids). With a deferring
    ``store`` (:mod:`.weight_grad_store`) the gradient is pushed there for ``W``."""
    deferred = deferring_store(store, weight)
    if deferred is not None:
        return _FusedWgradEmbedding.apply(ids, weight.detach(), _anchor(weight), sink, (deferred, weight))
    if sink is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight)
    return _FusedWgradEmbedding.apply(ids, weight, None, sink, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink, store=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with a ``sink`` and a weight that needs its gradient
    while autograd records, ``dW`` is accumulated by the sink instead (module docstring); with a
    deferring ``store`` (:mod:`.weight_grad_store`) ``dW`` is pushed there for ``W`` (``dX`` and
    ``db`` stay in the backward)."""
    deferred = deferring_store(store, weight)
    if deferred is not None:
        needs = x.requires_grad or (bias is not None and bias.requires_grad)
        return _FusedWgradLinear.apply(x, weight.detach(), bias, None if needs else _anchor(weight), sink,
                                       (deferred, weight))
    if sink is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    return _FusedWgradLinear.apply(x, weight, bias, None, sink, None)
