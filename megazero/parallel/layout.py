"""The arithmetic of a parallel layout: rank lists of every group kind, the layers of each
pipeline chunk, the shape of the activations between stages. Pure functions of sizes: no process
group, no model, no flags (the arguments package checks layouts with them before any rank starts;
:class:`~megazero.parallel.topology.Topology` creates the groups from :func:`layout`).

Pipeline chunks: with ``PP`` pipeline ranks and ``VP`` chunks per rank there are ``S = PP * VP``
virtual stages; the ``L`` layers are split evenly, ``L / S`` consecutive layers per virtual stage,
and chunk ``c`` of pipeline rank ``r`` is virtual stage ``s = c * PP + r`` (Megatron's interleaved
order: PP = 2, VP = 2, 8 layers -> rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7).
The input side (e.g. an embedding) lives on virtual stage 0 (chunk 0 of pipeline rank 0), the
output side and the loss on virtual stage ``S - 1`` (the last chunk of the last pipeline rank).  The V
placement of the zero-bubble schedules (``zbv``, ``dualpipev``; :func:`stage_of_chunk`) puts
chunk 0 of rank ``r`` at stage ``r`` and chunk 1 at stage ``2 PP - 1 - r``.
"""

from __future__ import annotations

import torch


GROUP_KINDS = ("tp", "dp", "pp", "model_parallel", "embedding", "position_embedding", "cp", "dp_cp", "tp_cp",
               "ep", "etp", "edp", "tp_ep")
EXPERT_KINDS = ("ep", "etp", "edp", "tp_ep")


def expert_groups_needed(tp: int, cp: int, ep: int, etp: int | None) -> bool:
    """Whether the expert grid differs from the dense one (EP > 1, ETP != TP or CP > 1)."""
    return ep > 1 or (etp if etp is not None else tp) != tp or cp > 1


def layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
           etp: int | None = None) -> dict[str, list[list[int]]]:
    """Return every group kind's rank lists for ``world_size`` ranks (no process groups); the
    ``cp`` kind only when CP > 1, the expert kinds only when :func:`expert_groups_needed`.
    ``etp``: the expert-tensor-parallel size (None: TP).

    Raises ``ValueError`` when ``world_size`` is not divisible by ``tp * cp * pp`` or
    ``etp * ep`` does not divide a stage's ``tp * cp * dp`` ranks.
    """
    etp = tp if etp is None else etp
    if min(tp, pp, cp, ep, etp, world_size) < 1:
        raise ValueError(f"sizes must be positive: world {world_size}, TP {tp}, CP {cp}, EP {ep}, ETP {etp}, PP {pp}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP {tp} x CP {cp} x PP {pp} = {tp * cp * pp}")
    dp = world_size // (tp * cp * pp)
    if (tp * cp * dp) % (etp * ep):
        raise ValueError(f"expert TP {etp} x EP {ep} = {etp * ep} does not divide the {tp * cp * dp} ranks of a "
                         f"pipeline stage (TP {tp} x CP {cp} x DP {dp}; world {world_size} / PP {pp})")
    grid = torch.arange(world_size).view(pp, dp, cp, tp)
    groups = {
        "tp": grid.reshape(-1, tp).tolist(),
        "dp": grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist(),
        "pp": grid.permute(1, 2, 3, 0).reshape(-1, pp).tolist(),
        "model_parallel": grid.permute(1, 2, 0, 3).reshape(dp * cp, -1).tolist(),
    }
    if cp > 1:
        groups["cp"] = grid.permute(0, 1, 3, 2).reshape(-1, cp).tolist()
        groups["dp_cp"] = grid.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()
        groups["tp_cp"] = grid.reshape(-1, cp * tp).tolist()
    if expert_groups_needed(tp, cp, ep, etp):
        edp = tp * cp * dp // (etp * ep)
        egrid = torch.arange(world_size).view(pp, edp, ep, etp)
        groups["ep"] = egrid.permute(0, 1, 3, 2).reshape(-1, ep).tolist()
        groups["etp"] = egrid.reshape(-1, etp).tolist()
        groups["edp"] = egrid.permute(0, 2, 3, 1).reshape(-1, edp).tolist()
        groups["tp_ep"] = egrid.reshape(-1, ep * etp).tolist()
    ends = sorted({0, pp - 1})
    groups["embedding"] = [[r[i] for i in ends] for r in groups["pp"]]
    groups["position_embedding"] = [[r[0]] for r in groups["pp"]]
    return groups


V_SCHEDULES = ("zbv", "dualpipev")


def chunk_placement(schedule: str | None) -> str:
    """``"v"`` for the V-shaped pipeline schedules (``zbv``, ``dualpipev``), else ``"loop"``."""
    return "v" if schedule in V_SCHEDULES else "loop"


def stage_of_chunk(pp: int, vp: int, pp_rank: int, chunk: int, placement: str = "loop") -> int:
    """The virtual stage of ``pp_rank``'s chunk ``chunk``.

    ``placement="loop"`` (Megatron's interleaved order): ``s = chunk * PP + pp_rank``.
    ``placement="v"`` (zero-bubble V, needs VP = 2): chunk 0 is stage ``pp_rank`` and chunk 1 is
    stage ``2 PP - 1 - pp_rank`` -- the stages go down the ranks and come back up, so rank 0 holds
    both the first and the last stage and the turn at rank ``PP - 1`` (stage ``PP - 1`` -> ``PP``)
    stays on one rank.
    """
    if placement == "v":
        if vp != 2:
            raise ValueError(f"the V placement needs exactly 2 chunks per pipeline rank, got VP {vp}")
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    if placement != "loop":
        raise ValueError(f"unknown chunk placement {placement!r} (loop or v)")
    return chunk * pp + pp_rank


def rank_of_stage(pp: int, stage: int, placement: str = "loop") -> tuple[int, int]:
    """``(pp_rank, chunk)`` holding virtual stage ``stage`` (inverse of :func:`stage_of_chunk`)."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def chunk_layer_ranges(num_layers: int, pp: int, vp: int, pp_rank: int,
                       placement: str = "loop") -> list[tuple[int, int]]:
    """``[(layer_start, layer_end), ...]`` of each of ``pp_rank``'s VP chunks (global layers):
    virtual stage ``s`` (:func:`stage_of_chunk`) holds layers ``[s L / S, (s + 1) L / S)``."""
    stages = pp * vp
    if num_layers % stages:
        fold = " (the V folds the layers into 2 x PP stages)" if placement == "v" else ""
        raise ValueError(f"{num_layers} layers cannot be split evenly over PP {pp} x VP {vp} = {stages} chunks{fold}")
    per = num_layers // stages
    return [(s * per, (s + 1) * per) for s in (stage_of_chunk(pp, vp, pp_rank, c, placement) for c in range(vp))]


def chunk_roles(pp: int, vp: int, pp_rank: int, placement: str = "loop") -> list[tuple[bool, bool]]:
    """``[(pre_process, post_process), ...]`` of each chunk: input-side (virtual stage 0) /
    output-and-loss (virtual stage ``S - 1``) owner.  With the V both are on pipeline rank 0."""
    last = pp * vp - 1
    return [(s == 0, s == last) for s in (stage_of_chunk(pp, vp, pp_rank, c, placement) for c in range(vp))]


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int,
                          tensor_parallel_size: int = 1, sequence_parallel: bool = False) -> tuple:
    """Shape of the hidden states sent between stages: ``[s(/TP), b, h]``."""
    if sequence_parallel:
        if seq_length % tensor_parallel_size:
            raise ValueError(f"sequence length {seq_length} not divisible by TP {tensor_parallel_size}")
        seq_length //= tensor_parallel_size
    return (seq_length, micro_batch_size, hidden_size)
