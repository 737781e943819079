"""Which submodules are ZeRO-3 units (one flat all-gather each) when the user names none.

Rule, in order:

1. the children of every ``nn.ModuleList`` / ``nn.ModuleDict`` (transformer layers: HF's
   ``encoder.layer[i]``, ``transformer.h[i]``), as :func:`megazero.zero.find_units`;
2. a model without such lists: by size. With ``T`` trainable elements, a floor
   ``f = max(T / 32, 1)`` and a ceiling ``c = max(T / 4, f)``, descend from the root: a child
   holding fewer than ``f`` elements stays in the root unit; a child holding more than ``c``
   with a child of its own of ``>= f`` elements (a wrapper: ``model.backbone``) is descended
   into; any other child is a unit. So an ``nn.Sequential`` of blocks becomes one unit per block,
   and a unit is at least 1/32 of the model (at most 32 units plus the root, whatever the depth).

Everything not in a unit (embeddings, heads, small modules) is the root unit, gathered for the
whole forward and backward; tied parameters stay whole anyway (:mod:`megazero.zero.regions`).
"""

from __future__ import annotations

from torch import nn


def _numel(m: nn.Module, recurse: bool = True) -> int:
    return sum(p.numel() for p in m.parameters(recurse=recurse) if p.requires_grad)


def default_units(model: nn.Module):
    """``None`` (rule 1: the ModuleList children, found by the optimizer) or the modules of rule 2."""
    if any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in model.modules()):
        return None
    total = _numel(model)
    floor = max(total // 32, 1)
    ceiling = max(total // 4, floor)
    units = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if _numel(child) < floor:
                continue
            if _numel(child) > ceiling and any(_numel(k) >= floor for k in child.children()):
                visit(child)
            else:
                units.append(child)
    visit(model)
    return [units] if units else None
