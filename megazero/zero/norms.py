"""This rank's partial sums for Megatron-LM's ``--log-params-norm`` and ``--log-num-zeros-in-grad``.

Both return a device tensor and run no collective and no host read: the training loop adds them
into its one packed all-reduce. They count what :meth:`ZeroOptimizer.grad_partials` counts for
the gradient norm, the regions' ``norm_segments`` (each parameter once: a TP-duplicated
parameter on TP rank 0 only, a tied copy on its tie group's first rank only; no padding), so they
sum to the model's value over the same group as the gradient norm (``ZeroOptimizer.norm_group``:
the model-parallel group at stage 0, where every DP rank holds the whole shard, else the world).

* **params norm** (Megatron-LM core_v0.15.0 ``megatron/training/utils.py`` ``calc_params_l2_norm``,
  called in ``train()`` after ``train_step``, i.e. on the parameters *after* the optimizer step,
  skipped or not): ``sqrt(sum_p |w_p|^2)`` over every parameter counted once across TP
  (``param_is_not_tensor_parallel_duplicate``) and tied copies (``param_is_not_shared``). The
  values are the fp32 master weights with ``--bf16`` (Megatron's ``main_param``) and fp32, the
  fp16 model weights with ``--fp16`` (Megatron's ``param.data``): the master rounded to fp16.
  The squares are summed in fp32 (Megatron's ``multi_tensor_l2norm``).
* **num zeros** (core_v0.15.0 ``megatron/core/optimizer/clip_grads.py`` ``count_zeros_fp32``,
  called by ``MixedPrecisionOptimizer.step`` after the inf check and clipping): the number of
  elements equal to 0 in the unscaled fp32 main gradients of the same parameters; None (not
  printed) for a skipped step. Counted here before clipping: a clip factor ``c <= 1`` turns a
  nonzero ``x`` into 0 only if ``|c x|`` underflows fp32 (below 1.4e-45).
"""

from __future__ import annotations

import torch

SLICE = 1 << 24  # elements rounded to fp16 at a time (temporaries <= 96 MB)


def count_zeros(pieces, device=None) -> torch.Tensor:
    """``sum_i (numel_i - count_nonzero_i)`` over the gradient pieces, as an int64 device scalar."""
    if not pieces:
        return torch.zeros((), dtype=torch.int64, device=device)
    total = sum(p.numel() for p in pieces)
    return total - torch.stack([torch.count_nonzero(p) for p in pieces]).sum()


def params_sum_of_squares(regions, params_dtype: torch.dtype, device=None, world: bool = False) -> torch.Tensor:
    """``sum w^2`` (fp32 device scalar) over the counted segments of the regions' master shards;
    with fp16 parameters, of the master rounded to fp16 (the model weights Megatron reads).
    ``world``: to be summed over the world (a stage-0 region counts on its first replica only)."""
    pieces = [r.master[a:b] for r in regions if not world or r.counts_in_world for a, b in r.norm_segments]
    if not pieces:
        return torch.zeros((), dtype=torch.float32, device=device)
    if params_dtype != torch.float16:
        return torch.stack(torch._foreach_norm(pieces)).square().sum()
    total = torch.zeros((), dtype=torch.float32, device=pieces[0].device)
    for p in pieces:  # one slice at a time: the fp16 copy and its fp32 reading stay small
        for i in range(0, p.numel(), SLICE):
            total += torch.linalg.vector_norm(p[i:i + SLICE].to(torch.float16), dtype=torch.float32).square()
    return total


def params_sq(optimizer, over_world: bool = False) -> torch.Tensor:
    """This rank's partial ``sum w^2`` of a :class:`ZeroOptimizer` (shape [1], fp32, on its device)
    to be summed over ``optimizer.norm_group``; ``over_world``: summed over the whole world
    instead, so at stage 0 only DP rank 0 contributes (as ``grad_partials``). Reads the fp32
    masters, which are current after ``apply_step`` even while an overlapped parameter all-gather
    is still in flight."""
    world = over_world or optimizer.norm_group == "world"
    return params_sum_of_squares(optimizer.regions, optimizer.params_dtype, optimizer.device, world).reshape(1)
