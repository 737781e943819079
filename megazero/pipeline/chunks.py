"""How a GPT is cut into pipeline chunks, and the tied-embedding gradient sync between stages.

With ``PP`` pipeline ranks and ``VP`` chunks per rank there are ``S = PP * VP`` virtual stages;
the ``L`` layers are split evenly, ``L / S`` consecutive layers per virtual stage, and chunk
``c`` of pipeline rank ``r`` is virtual stage ``s = c * PP + r`` (Megatron's interleaved order:
PP = 2, VP = 2, 8 layers -> rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7).  The
embedding lives on virtual stage 0 (chunk 0 of pipeline rank 0), the final norm, output layer
and loss on virtual stage ``S - 1`` (the last chunk of the last pipeline rank).

Tied embeddings with PP > 1: the last stage keeps its own copy of the word-embedding weight
(initialized equal to the first stage's); :func:`allreduce_shared_embedding_grads` sums the two
copies' gradients over the embedding group (first and last stage of each pipeline) before
every optimizer step -- volume ``V h / TP`` per rank, all-reduce -- so the copies stay equal.

This module imports only torch and (lazily, inside :func:`build_model_chunks`)
``megazero.model``: the seam where the pipeline package meets the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_layer_ranges(num_layers: int, pp: int, vp: int, pp_rank: int) -> list[tuple[int, int]]:
    """``[(layer_start, layer_end), ...]`` of each of ``pp_rank``'s VP chunks (global layers)."""
    stages = pp * vp
    if num_layers % stages:
        raise ValueError(f"{num_layers} layers cannot be split evenly over PP {pp} x VP {vp} = {stages} chunks")
    per = num_layers // stages
    return [((c * pp + pp_rank) * per, (c * pp + pp_rank + 1) * per) for c in range(vp)]


def chunk_roles(pp: int, vp: int, pp_rank: int) -> list[tuple[bool, bool]]:
    """``[(pre_process, post_process), ...]`` of each chunk: embedding / head-and-loss owner."""
    return [(c == 0 and pp_rank == 0, c == vp - 1 and pp_rank == pp - 1) for c in range(vp)]


def build_model_chunks(config, topo) -> list[torch.nn.Module]:
    """This rank's VP ``GPTModel`` slices, in virtual-stage order (see module docstring)."""
    from megazero.model import GPTModel  # the one place the pipeline reaches the model

    ranges = chunk_layer_ranges(config.num_layers, topo.pp, topo.vp, topo.pp_rank)
    roles = chunk_roles(topo.pp, topo.vp, topo.pp_rank)
    return [GPTModel(config, topo, layer_start=start, layer_end=end, pre_process=pre, post_process=post)
            for (start, end), (pre, post) in zip(ranges, roles)]


def gpt_forward_step(chunk, microbatch: dict, input_tensor):
    """``forward_step_func`` for ``GPTModel`` chunks: hidden states, or on the last stage the
    micro-batch's mean loss over its unmasked tokens (``sum(loss * mask) / sum(mask)``)."""
    x = microbatch["tokens"] if input_tensor is None else input_tensor
    if not getattr(chunk, "post_process", False):
        return chunk(x, position_ids=microbatch.get("position_ids"))
    losses = chunk(x, position_ids=microbatch.get("position_ids"), labels=microbatch["labels"])
    mask = microbatch.get("loss_mask")
    if mask is None:
        return losses.float().mean()
    mask = mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum()


def shared_embedding_params(chunks, topo) -> list:
    """``[(weight, embedding group)]`` for this rank's copy of a tied word embedding, or ``[]``.

    Only with PP > 1 on the first or last stage of a model with tied embeddings (the chunk's
    ``shared_embedding_weight()`` is not None).  This is the ``shared_params`` argument of the
    ZeRO optimizer when it manages gradient reduction.
    """
    if topo.pp == 1 or not (topo.is_first_stage or topo.is_last_stage):
        return []
    out = []
    owners = ([chunks[0]] if topo.is_first_stage else []) + ([chunks[-1]] if topo.is_last_stage else [])
    for chunk in owners:
        getter = getattr(chunk, "shared_embedding_weight", None)
        weight = getter() if getter is not None else None
        if weight is not None:
            out.append((weight, topo.embedding_group))
    return out


def allreduce_shared_embedding_grads(chunks, topo) -> None:
    """Sum the tied word-embedding copies' ``.grad`` over the embedding group (first + last
    stage), so both copies take the same optimizer step.  Call after the schedule, before the
    optimizer, when no ZeRO optimizer manages the sync.  No-op with PP = 1 or untied weights.

    Both stages must agree on tying (they do when built from one config); a copy that received
    no gradient contributes zeros.
    """
    for weight, group in shared_embedding_params(chunks, topo):
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=group)
