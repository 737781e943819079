"""Split backward: a chunk's weight gradients computed later than its input gradients.

A zero-bubble pipeline schedule splits each backward ``B`` of a micro-batch into the input
gradient (``dX = G W``, on the critical path: the previous stage waits for it) and the weight
gradient (``dW = G^T X``, free to move into the schedule's idle slots, action ``W``). One
:class:`WeightGradStore` per model chunk, passed explicitly (``store.attach(chunk)`` gives it to
the chunk's layers; the pipeline runner gets the list), does the bookkeeping:

* while :meth:`WeightGradStore.deferring` is on (the runner turns it on around the ``F`` and
  the ``B`` of a micro-batch whose plan has a ``W``), a deferring layer (every linear of
  :mod:`.layers`, the vocabulary embedding and the MoE experts) gives its autograd Function the
  weight *detached*: the graph holds no edge to the weight's ``AccumulateGrad``, so nothing of
  the weight happens in ``B`` -- no ``.grad``, no post-accumulate hook;
* the Function's backward returns ``dX`` (and the bias's ``db``, which stays in ``B``) and pushes
  a closure over what ``dW`` needs (the saved input ``X`` and the output gradient ``G``) under
  the micro-batch being back-propagated;
* :meth:`WeightGradStore.run` (action ``W``) runs micro-batch ``m``'s closures in push order
  (the backward's order), sums each weight's contributions and delivers the sum through the
  weight's own ``AccumulateGrad`` (one autograd call over a chain of :class:`_Deliver` nodes,
  one per weight: one engine start per ``W``, not per weight): ``.grad`` accumulates and the
  post-accumulate hooks (ZeRO's gradient reduction) fire once per weight and micro-batch, as in
  an undivided backward -- only later. A gradient-accumulation-fusion sink (:mod:`.wgrad_fusion`) is called
  at ``W`` the same way, then the weight's hook fires with ``.grad`` None, as today.

Memory: each deferred weight keeps ``X`` (already saved for the backward; with sequence
parallelism the all-gathered ``X``, kept rather than gathered again at ``W``) and ``G`` from
``B`` until ``W``; ``W`` drops each weight's ``X`` and ``G`` as soon as its ``dW`` is computed
(the next weight's ``dW`` can reuse that memory instead of fresh pages: on a CPU, pages faulted
in for each ``dW`` are a large part of the split's measured extra cost, docs/benchmarks.md).
Outside :meth:`deferring` the layers run their ordinary backward.

Megatron-core 0.16.1 has the same split as ``delay_wgrad_compute`` (model_parallel_config.py,
Transformer Engine's ``backward_dw``); ``torch.distributed.pipelining`` (``_backward.py``:
``stage_backward_input`` / ``stage_backward_weight``) instead splits the autograd graph and runs
the weight part as a second ``autograd.grad`` over the retained graph (docs/pipeline.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _Deliver(torch.autograd.Function):
    """One link of :meth:`WeightGradStore.run`'s chain: its backward computes ``weight``'s
    gradient (``compute()``; None when a fusion sink took it) and hands it to the weight's
    ``AccumulateGrad``, so the weight's hooks run as in an ordinary backward; the chain's
    previous link (``prev``) runs next. ``AccumulateGrad`` nodes run as soon as they are ready,
    so one weight's gradient is delivered (and, under ZeRO, taken into the flat buffer) before
    the next one is computed: one gradient of a weight's size exists at a time."""

    @staticmethod
    def forward(ctx, weight, prev, compute, first):
        ctx.compute, ctx.first = compute, first
        return prev.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grad, ctx.compute = ctx.compute(), None  # autograd runs backwards without recording
        return grad, None if ctx.first else _empty(), None, None


def _empty() -> torch.Tensor:
    return torch.empty(0)


def _summed(closures):
    """``compute()`` of a weight used several times: the sum of its contributions."""
    def compute():
        total = None
        while closures:  # each closure dropped once run: its G and X are freed before the next dW
            g = closures.pop(0)()
            if g is not None:
                total = g if total is None else total + g
        return total
    return compute


class WeightGradStore:
    """One model chunk's deferred weight gradients (module docstring).

    ``defer``: whether layers called now defer their weight gradient (set by :meth:`deferring`);
    ``micro_batch``: the micro-batch a backward now pushes under."""

    def __init__(self):
        self.defer = False
        self.micro_batch = None
        self._queued: dict = {}  # micro-batch -> {id(weight): (weight, [closures])}, push order

    def attach(self, root: torch.nn.Module) -> "WeightGradStore":
        """Give this store to every module under ``root`` that defers weight gradients (those
        with a ``weight_grad_store`` attribute); returns self."""
        for module in root.modules():
            if hasattr(module, "weight_grad_store"):
                module.weight_grad_store = self
        return self

    @contextmanager
    def deferring(self, micro_batch, on: bool = True):
        """Within: layers defer their weight gradients (when ``on``), and backwards push them
        under ``micro_batch``. Wrap both the forward and the backward of that micro-batch (a
        recomputed forward runs inside the backward and must take the same path)."""
        saved = self.defer, self.micro_batch
        self.defer, self.micro_batch = bool(on), micro_batch
        try:
            yield self
        finally:
            self.defer, self.micro_batch = saved

    def push(self, weight: torch.Tensor, compute) -> None:
        """Queue ``compute() -> dW`` (or None when it added ``dW`` to a fusion sink itself) for
        ``weight`` under the current micro-batch."""
        if self.micro_batch is None:
            raise RuntimeError("a deferred weight gradient was produced outside WeightGradStore.deferring "
                               "(run the backward of a deferred forward inside deferring(micro_batch))")
        queue = self._queued.setdefault(self.micro_batch, {})
        queue.setdefault(id(weight), (weight, []))[1].append(compute)

    def run(self, micro_batch) -> int:
        """Action ``W``: compute and deliver micro-batch ``micro_batch``'s weight gradients, in
        push order (each weight's contributions summed, delivered once, through its
        ``AccumulateGrad``), in one autograd call; returns how many weights got one."""
        pairs = list(self._queued.pop(micro_batch, {}).values())
        count = len(pairs)
        if not count:
            return 0
        with torch.enable_grad():
            link = first = torch.empty(0, requires_grad=True)
            while pairs:  # the last link runs first; only the chain holds the closures (module doc)
                weight, closures = pairs.pop()
                link = _Deliver.apply(weight, link, _summed(closures), link is first)
            del weight, closures, first
            torch.autograd.backward(link, torch.empty(0))
        return count

    def pending(self) -> list:
        """Micro-batches whose weight gradients are still queued."""
        return list(self._queued)

    def clear(self) -> None:
        """Drop everything queued (a failed step)."""
        self._queued.clear()


def weight_grad_stores(chunks) -> list[WeightGradStore]:
    """One store per chunk, attached to the chunk's deferring layers (in chunk order)."""
    return [WeightGradStore().attach(chunk) for chunk in chunks]


def deferring_store(store, weight: torch.Tensor):
    """``store`` when a layer's use of ``weight`` now defers its gradient: the store is on, autograd
    records, and ``weight`` is a leaf that needs a gradient (a computed weight -- a cast, a view --
    is differentiated now, through its graph); else None."""
    if store is None or not store.defer or not torch.is_grad_enabled():
        return None
    return store if (weight.is_leaf and weight.requires_grad) else None
