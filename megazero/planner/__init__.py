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

A Mixture-of-Experts model (``--num-experts`` and the ``--moe-*`` flags) adds the expert grid:
EP (``--expert-model-parallel-size`` fixes it, else every EP dividing the experts) and expert TP
(``--expert-tensor-parallel-size``, default TP), with ETP x EP dividing a stage's TP x DP ranks;
expert states are partitioned over EDP = TP DP / (ETP EP).

The formulas (parameters, ZeRO model states, activations, communication per step) are
:mod:`megazero.model.memory`'s and, for the experts, :mod:`megazero.model.expert_memory`'s,
which the flags' checks use too.
"""

from __future__ import annotations

from megazero.model.config import GPTConfig
from megazero.model.expert_memory import (dispatch_bytes, dispatch_rows_per_direction,  # noqa: F401
                                          expert_data_parallel, moe_activation_delta, moe_block_params,
                                          routed_rows)
from megazero.model.memory import (GiB, Layout, active_params, chunk_activation_bytes, embedding_params,  # noqa: F401
                                   estimate, head_params, layer_activation_bytes, layer_params, model_state_bytes,
                                   norm_params, stage_layers, stage_param_split, stage_params, total_params)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_layouts(shape: GPTConfig, tp: int, dp: int, ep: int | None = None,
                   etp: int | None = None) -> list[tuple[int, int]]:
    """The (EP, ETP) pairs a (TP, DP) stage can take: EP divides the experts, ETP (default TP)
    divides the expert FFN size, and ETP x EP divides the stage's TP x DP ranks (Megatron's expert
    grid). A dense model: ``[(1, TP)]``."""
    if shape.moe is None:
        return [(1, tp)]
    E, e_tp = shape.moe.num_experts, etp or tp
    if shape.moe.ffn_hidden_size % e_tp:
        return []
    return [(e, e_tp) for e in ([ep] if ep else divisors(E)) if not E % e and not (tp * dp) % (e_tp * e)]


def plan(shape: GPTConfig, world_size: int, *, micro_batch_size: int, global_batch_size: int | None = None,
         tp: int | None = None, pp: int | None = None, zero: int | None = None, max_tp: int = 8,
         layers_per_virtual_stage: int | None = None, ep: int | None = None, etp: int | None = None,
         **kw) -> list[Layout]:
    """Every valid layout, sorted by per-GPU memory (then communication). An MoE model's layouts
    also range over EP (``ep`` fixes it) with expert TP ``etp`` (default TP): :func:`expert_layouts`."""
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
            for e, e_tp in expert_layouts(shape, t, n, ep, etp):
                for z in ([zero] if zero is not None else [0, 1, 2, 3] if n > 1 else [0]):
                    out.append(estimate(shape, t, p, n, z, micro_batch_size=micro_batch_size, micro_batches=m,
                                        vp=v, ep=e, etp=e_tp, **kw))
    return sorted(out, key=lambda x: (x.total_bytes, x.comm_bytes))


# ---- command line --------------------------------------------------------------------------
