"""Layout planner: per-GPU memory, communication and estimated step time of every (TP, PP, DP, ZeRO)
layout; the command line ranks those that fit by the time on a GPU preset (``--gpu``,
:mod:`megazero.planner.presets`, :mod:`megazero.planner.timing`) and names the top one and why.

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
expert states are partitioned over EDP = TP CP DP / (ETP EP).

Context parallelism (``--context-parallel-size`` fixes CP, default 1; ``--try-context-parallel``
tries every CP dividing world / (TP PP)) splits each sequence over CP ranks with
``--cp-comm-type`` p2p (ring) or a2a (Ulysses): DP = world / (TP CP PP), the sequence in 2 CP
chunks (p2p) or CP (a2a), x TP with SP, and with a2a the heads and query groups per TP rank
divisible by CP; ZeRO partitions over DP x CP.

The attention backend (``--use-flash-attn``, ``--attention-backend``) decides whether a layer keeps
Korthikanti's ``5 a s^2 b`` scores: only ``unfused``/``local`` do (:func:`megazero.planner.cli.attention_keeps_scores`).
The formulas (parameters, ZeRO model states, activations, communication per step) are
:mod:`megazero.planner.memory`'s and, for the experts and CP, :mod:`megazero.planner.expert_memory`'s
and :mod:`megazero.planner.cp_memory`'s, which the flags' checks use too.
"""

from __future__ import annotations

from megazero.model.config import GPTConfig
from megazero.planner.cp_memory import (check_cp_layout, cp_attention_bytes, cp_attention_kept_bytes,  # noqa: F401
                                      cp_chunk_activation_bytes, cp_valid, ring_bytes, ring_transient_bytes,
                                      ulysses_bytes)
from megazero.planner.expert_memory import (dispatch_bytes, dispatch_rows_per_direction,  # noqa: F401
                                          expert_data_parallel, moe_activation_delta, moe_block_params,
                                          routed_rows)
from megazero.planner.memory import (GiB, Layout, active_params, chunk_activation_bytes, embedding_params,  # noqa: F401
                                   estimate, head_params, layer_activation_bytes, layer_params, model_state_bytes,
                                   norm_params, stage_layers, stage_param_split, stage_params, total_params)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_layouts(shape: GPTConfig, tp: int, dp: int, ep: int | None = None,
                   etp: int | None = None, cp: int = 1) -> list[tuple[int, int]]:
    """The (EP, ETP) pairs a (TP, CP, DP) stage can take: EP divides the experts, ETP (default TP)
    divides the expert FFN size, and ETP x EP divides the stage's TP x CP x DP ranks (Megatron's
    expert grid). A dense model: ``[(1, TP)]``."""
    if shape.moe is None:
        return [(1, tp)]
    E, e_tp = shape.moe.num_experts, etp or tp
    if shape.moe.ffn_hidden_size % e_tp:
        return []
    return [(e, e_tp) for e in ([ep] if ep else divisors(E)) if not E % e and not (tp * cp * dp) % (e_tp * e)]


def pipelines(shape: GPTConfig, world_size: int, tp: int | None = None, pp: int | None = None, max_tp: int = 8,
              layers_per_virtual_stage: int | None = None):
    """The valid (TP, PP, VP) triples: TP divides the heads and query groups (at most ``max_tp``),
    PP the layers (PP x ``layers_per_virtual_stage`` with interleaving, VP = L / that), TP PP the world."""
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
            yield t, p, v


def micro_batches(global_batch_size: int | None, micro_batch_size: int, dp: int, pp: int, vp: int) -> int | None:
    """M = GBS / (mbs DP) per DP rank (CP ranks share their samples), None unless whole (and a multiple
    of PP when interleaved); 4 PP without a global batch."""
    if not global_batch_size:
        return 4 * pp
    if global_batch_size % (micro_batch_size * dp):
        return None
    m = global_batch_size // (micro_batch_size * dp)
    return None if vp > 1 and m % pp else m


def schedule_variants(shape: GPTConfig, pp: int, vp: int, m: int, schedules) -> list[tuple[str | None, int]]:
    """The (schedule, VP) pairs a (PP, VP) layout with M micro-batches runs: ``[(None, VP)]`` (1F1B or
    interleaved 1F1B) unless ``schedules`` names some; of those, the ones that fit: ``zb-h1`` without
    virtual stages, ``interleaved-zb`` with them (M a multiple of ``max(1, M // PP)``), ``zbv`` and
    ``dualpipev`` (``M >= 2 PP``) with 2 chunks per rank when ``2 PP`` divides the layers."""
    if not schedules or pp == 1:
        return [(None, vp)]
    out = []
    for name in schedules:
        if name in ("zbv", "dualpipev"):
            if not shape.num_layers % (2 * pp) and (name == "zbv" or m >= 2 * pp):
                out.append((name, 2))
        elif (vp > 1) == (name in ("interleaved-1f1b", "interleaved-zb")):
            if name == "interleaved-zb" and m % max(1, m // pp) or name == "interleaved-1f1b" and m % pp:
                continue
            out.append((name, vp))
    return out


def plan(shape: GPTConfig, world_size: int, *, micro_batch_size: int, global_batch_size: int | None = None,
         tp: int | None = None, pp: int | None = None, zero: int | None = None, max_tp: int = 8,
         layers_per_virtual_stage: int | None = None, ep: int | None = None, etp: int | None = None,
         cp: int | None = 1, schedules=None, **kw) -> list[Layout]:
    """Every valid layout, sorted by per-GPU memory (then communication). An MoE model's layouts
    also range over EP (``ep`` fixes it) with expert TP ``etp`` (default TP): :func:`expert_layouts`.
    ``cp``: context-parallel ranks (default 1); None tries every CP dividing world / (TP PP) that can
    split the sequence (:func:`~megazero.planner.cp_memory.cp_valid`, ``shape.cp_comm_type``).
    ``schedules``: pipeline schedule names to rank each PP > 1 layout under (:func:`schedule_variants`;
    None: 1F1B / interleaved 1F1B as VP says)."""
    out, sp = [], kw.get("sequence_parallel", False)
    for t, p, v in pipelines(shape, world_size, tp, pp, max_tp, layers_per_virtual_stage):
        for c in ([cp] if cp else divisors(world_size // (t * p))):
            if world_size % (t * p * c) or not cp_valid(shape, c, t, sp):
                continue
            n = world_size // (t * p * c)
            m = micro_batches(global_batch_size, micro_batch_size, n, p, 1 if schedules else v)
            if m is None:
                continue
            # With DP x CP = 1 every ZeRO stage is stage 0: list it once unless a stage was asked for.
            for (name, sv), (e, e_tp) in ((x, y) for x in schedule_variants(shape, p, v, m, schedules)
                                          for y in expert_layouts(shape, t, n, ep, etp, c)):
                for z in ([zero] if zero is not None else [0, 1, 2, 3] if n * c > 1 else [0]):
                    out.append(estimate(shape, t, p, n, z, micro_batch_size=micro_batch_size, micro_batches=m,
                                        vp=sv, ep=e, etp=e_tp, cp=c, schedule=name, **kw))
    return sorted(out, key=lambda x: (x.total_bytes, x.comm_bytes))


# ---- command line --------------------------------------------------------------------------
