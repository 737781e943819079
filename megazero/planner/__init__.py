"""Memory planner: per-GPU memory and communication of every (TP, PP, DP, ZeRO) layout.

    python -m megazero.planner --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --micro-batch-size 4 --vocab-size 50257 --world-size 16 --bf16

Every ``pretrain_gpt.py`` flag is accepted (model shape, ``--swiglu``, ``--sequence-parallel``,
``--recompute-*``, ``--num-layers-per-virtual-pipeline-stage``, ``--global-batch-size``...), so a
training command line can be planned as is. ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size`` and ``--zero-stage`` fix that dimension when given;
otherwise every valid value is tried (with DP = 1 the ZeRO stages coincide: stage 0 only). Valid layouts: TP divides the heads (and the KV groups) and
TP <= ``--max-tensor-parallel-size`` (8, one node), PP divides the layers (and PP * layers per
virtual stage divides them with interleaving), DP = world / (TP PP) is whole, and with
``--global-batch-size`` the micro-batch count M = GBS / (mbs DP) is whole (a multiple of PP
when interleaved). Without it, M = 4 PP (enough to fill the pipeline).

The formulas (parameters, ZeRO model states, activations, communication per step) are
:mod:`megazero.model.memory`'s, which the flags' checks use too.
"""

from __future__ import annotations

from megazero.model.config import GPTConfig
from megazero.model.memory import (GiB, Layout, chunk_activation_bytes, embedding_params, estimate,  # noqa: F401
                                   head_params, layer_activation_bytes, layer_params, model_state_bytes,
                                   norm_params, stage_params, total_params)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(shape: GPTConfig, world_size: int, *, micro_batch_size: int, global_batch_size: int | None = None,
         tp: int | None = None, pp: int | None = None, zero: int | None = None, max_tp: int = 8,
         layers_per_virtual_stage: int | None = None, **kw) -> list[Layout]:
    """Every valid layout, sorted by per-GPU memory (then communication)."""
    out = []
    for t in ([tp] if tp else divisors(world_size)):
        if t > max_tp or shape.num_attention_heads % t or shape.num_query_groups % t:
            continue
        for p in ([pp] if pp else divisors(world_size // t)):
            if world_size % (t * p) or shape.num_layers % p:
                continue
            v = 1
            if layers_per_virtual_stage and p > 1:
                if shape.num_layers % (p * layers_per_virtual_stage):
                    continue
                v = shape.num_layers // (p * layers_per_virtual_stage)
            n = world_size // (t * p)
            if global_batch_size:
                if global_batch_size % (micro_batch_size * n):
                    continue
                m = global_batch_size // (micro_batch_size * n)
                if v > 1 and m % p:
                    continue
            else:
                m = 4 * p
            # With DP = 1 every ZeRO stage is stage 0: list it once unless a stage was asked for.
            for z in ([zero] if zero is not None else [0, 1, 2, 3] if n > 1 else [0]):
                out.append(estimate(shape, t, p, n, z, micro_batch_size=micro_batch_size, micro_batches=m,
                                    vp=v, **kw))
    return sorted(out, key=lambda x: (x.total_bytes, x.comm_bytes))


# ---- command line --------------------------------------------------------------------------
