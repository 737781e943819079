"""The engine's one-line errors: parameters not in the module, a module changed after
``initialize``, ranks holding different models; and the start-up line about slow ZeRO knobs."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


def check_registered(module: torch.nn.Module, params) -> None:
    """Every parameter of ``params`` must be one of ``module.parameters()``."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for k, p in enumerate(params):
        if id(p) not in names:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"megazero.initialize: model_parameters[{k}] (shape {shape}) is not a parameter "
                             "registered in the model; register it as an nn.Parameter of a submodule, or "
                             "leave it out of model_parameters")


def parameter_signature(module: torch.nn.Module) -> tuple:
    """``(name, id)`` of every parameter, in registration order (what must not change)."""
    return tuple((n, id(p)) for n, p in module.named_parameters())


def check_unchanged(module: torch.nn.Module, signature: tuple) -> None:
    """Refuse a module whose parameters were added, removed or replaced after ``initialize``."""
    now = parameter_signature(module)
    if now == signature:
        return
    before, after = dict(signature), dict(now)
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    replaced = [n for n in after if n in before and after[n] != before[n]]
    what = (f"added {added[0]}" if added else f"removed {removed[0]}" if removed else f"replaced {replaced[0]}")
    raise RuntimeError(f"megazero engine: the module's parameters changed after initialize ({what}); "
                       "ZeRO's flat buffers hold the parameters seen at initialize: change the model first, "
                       "then call megazero.initialize")


def check_same_model(module: torch.nn.Module, group=None) -> None:
    """Every rank must hold the same parameter names, shapes and dtypes (one all-gather of a
    checksum; on a mismatch, one more to name the first differing parameter)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    rows = [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in module.named_parameters()]
    mine = torch.tensor([zlib.crc32("\n".join(rows).encode())], dtype=torch.int64)
    sums = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sums, mine, group=group)
    if all(int(s) == int(sums[0]) for s in sums):
        return
    every = [None] * len(sums)
    dist.all_gather_object(every, rows, group=group)
    first = next(r for r in range(len(every)) if every[r] != every[0])
    diff = next((f"'{a}' vs '{b}'" for a, b in zip(every[0], every[first]) if a != b),
                f"{len(every[0])} vs {len(every[first])} parameters")
    raise ValueError(f"megazero.initialize: rank {first}'s model differs from rank 0's (name:shape:dtype:"
                     f"requires_grad {diff}); build the same model on every rank")


def slow_knobs(stage: int, reduce_bucket_size: int, prefetch_bucket_size: int, max_live: int,
               params, unit_sizes) -> str | None:
    """One line naming the config knobs that make this run slow here, with a better value, or
    None. megazero reduces a stage-3 unit's gradients and gathers its parameters as one flat
    collective whatever the buckets say, so ``reduce_bucket_size`` matters at stages 0-2 only
    (a bucket smaller than a parameter: one collective per parameter), and at stage 3
    ``stage3_max_live_parameters`` below the largest unit re-gathers every unit at every use and
    ``stage3_prefetch_bucket_size`` 0 turns prefetch off."""
    notes = []
    largest = max((p.numel() for p in params), default=0)
    if stage <= 2 and reduce_bucket_size < largest:
        n = len(params)
        notes.append(f"reduce_bucket_size {reduce_bucket_size} < the largest parameter ({largest} elements): "
                     f"about one collective per parameter ({n}); use >= {max(largest, 5 * 10 ** 8)} "
                     "(DeepSpeed's default 5e8)")
    if stage == 3 and unit_sizes and max_live < max(unit_sizes):
        notes.append(f"stage3_max_live_parameters {max_live} < the largest unit ({max(unit_sizes)} elements): "
                     "every unit is gathered again at every use; use >= 1e9 (DeepSpeed's default)")
    if stage == 3 and prefetch_bucket_size <= 0 and len(unit_sizes) > 1:
        notes.append("stage3_prefetch_bucket_size 0: no gather overlaps compute; use 5e7 (DeepSpeed's default)")
    return ("megazero: slow ZeRO settings: " + "; ".join(notes)) if notes else None
