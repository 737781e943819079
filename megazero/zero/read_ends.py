"""When a stage-3 unit's backward stops reading its parameters: hooks on its inputs' gradients.

A unit (:mod:`.stage3`) is gathered for its backward and may be released as soon as that backward
reads none of its parameters. Its gradients' completion (every parameter's ``AccumulateGrad``
ran) marks that point in an undivided backward, but not in a split one (a zero-bubble plan's
``B``, :mod:`megazero.tensor_parallel.weight_grad_store`): there the weights' gradients
``dW = G^T X`` arrive at the later ``W``, which reads the saved input ``X`` and output gradient
``G`` and no weight. The end of the reads is instead the moment every input of the unit has its
gradient:

* :func:`hook_inputs` (a forward pre-hook's work) replaces each tensor argument that needs a
  gradient by a view of itself (no copy) and hooks the view's gradient; ``on_end()`` runs once
  all of them have theirs. Autograd runs the ready node with the highest sequence number first,
  and every node of the unit's backward was recorded after those views, so the views' gradients
  arrive after every node of the unit's backward ran (each ``dX = G W`` and norm backward that
  reads a parameter, and the ``AccumulateGrad`` of each parameter whose gradient ``B`` computes);
  the view's gradient also arrives before its base's, so the release comes before the hooks on
  the base (the previous unit's gather for its backward) run.
* :func:`hook_outputs` does the same on a module's outputs, for a module whose backward reads no
  parameter (an embedding: ``dW[ids] += G``) and whose inputs need no gradient (token ids).

Each returns whether anything was hooked (nothing: no input needs a gradient, or autograd does
not record), so the caller knows whether this forward's backward will signal its end.
"""

from __future__ import annotations

import torch


def _counter(n: int, on_end):
    """A gradient hook that calls ``on_end()`` on its ``n``-th call."""
    left = [n]

    def hook(grad):
        left[0] -= 1
        if left[0] == 0:
            on_end()
    return hook


def hook_inputs(args: tuple, kwargs: dict, on_end):
    """``(args, kwargs)`` with every tensor that needs a gradient replaced by a hooked view (module
    docstring), or None when none needs one (or autograd does not record)."""
    if not torch.is_grad_enabled():
        return None
    needs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not needs:
        return None
    hook = _counter(len(needs), on_end)

    def viewed(a):
        if not (isinstance(a, torch.Tensor) and a.requires_grad):
            return a
        v = a.view_as(a)
        v.register_hook(hook)
        return v
    return tuple(viewed(a) for a in args), {k: viewed(v) for k, v in kwargs.items()}


def hook_outputs(output, on_end) -> bool:
    """Hook the gradients of ``output``'s tensors that need one; ``on_end()`` once all have theirs.
    False when none needs a gradient."""
    needs = [t for t in tensors_of(output) if t.requires_grad]
    if not needs or not torch.is_grad_enabled():
        return False
    hook = _counter(len(needs), on_end)
    for t in needs:
        t.register_hook(hook)
    return True


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_of(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_of(o)
