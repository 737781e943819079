"""An MoE GPT's memory and communication by formula: the planner's expert arithmetic.

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` whose ``moe`` is set (no process
group, no tensors); :mod:`megazero.planner.memory` counts the parameters and calls these for the
activations and the dispatcher. ``E`` experts of FFN size ``f`` (``u = 2 f`` with SwiGLU, else
``f``), top ``k``, hidden ``h``; a rank holds ``T = s b / TP`` tokens when it enters the MoE block
(sequence parallelism splits them over TP; without SP the block splits them itself).

**Routed rows** (:func:`routed_rows`): the (token, expert) pairs of a rank's ``T`` tokens --
``T k`` dropless; with ``--moe-expert-capacity-factor c`` each expert takes at most
``C = ceil(T k / E * c)`` of them (at most ``E C`` rows), and with
``--moe-pad-expert-input-to-capacity`` exactly ``E min(C, T)``. Balanced routing sends each rank
as many rows as it routes.

**Activations of an MoE layer** (:func:`moe_activation_delta`, 2-byte activations, per
micro-batch) -- what it keeps beyond the dense MLP's share of Korthikanti et al.'s figure
(``s b h (3 + 16/t)``, ``19 s b h / t`` with SP)::

    3 s b h (/t with SP)                          router / dispatcher input and the dropout mask
    + R (2 h ETP + 2 u + 2 f + 2 h)               R routed rows: the expert input all-gathered over
                                                  expert TP, fc1's output and fc2's input (split over
                                                  ETP), the returned rows the weights multiply
    + 2 s b (u_s + f_s) / t                       the shared expert (FFN f_s), when there is one

**Dispatcher volume** (:func:`dispatch_bytes`, bytes each rank sends per MoE layer and
micro-batch, forward and backward: a dispatch and a combine each way, ``x 3/2`` with full
recompute, which replays the forward's two)::

    alltoall    4 T k h A ((EP - 1) / EP + (ETP - 1))     rows to the other EP ranks (balanced
                                                          routing; at most T k h per direction), and
                                                          the expert-TP all-gather / reduce-scatter
    allgather   4 (G - 1) T h A,  G = EP ETP              every token to every rank of the group

(A = activation bytes; ``T k`` is :func:`routed_rows` with a capacity.) Not counted: the router's
``T E`` logits and probabilities, the counts exchanged before an all-to-all, and the allgather
dispatcher's gathered probabilities and routing map (``(G - 1) T E`` each) -- all ``E / h`` of the
rows or less.
"""

from __future__ import annotations

import math

from megazero.model.config import GPTConfig


def expert_data_parallel(tp: int, dp: int, ep: int, etp: int, cp: int = 1) -> int:
    """``EDP = TP CP DP / (ETP EP)``: the ranks holding the same expert shard (Megatron's expert grid)."""
    return tp * cp * dp // (etp * ep)


def moe_block_params(shape: GPTConfig, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one MoE block (the MLP's place) on one rank: the router ``E h``
    (replicated), the shared expert ``(u_s + f_s) h / TP`` (no biases with MoE) and its gate ``h``;
    this EP rank's ``E / EP`` routed experts, ``(u + f) h`` each split over expert TP."""
    moe, h = shape.moe, shape.hidden_size
    dense, fs = moe.num_experts * h, moe.shared_expert_intermediate_size
    if fs:
        dense += ((2 * fs if shape.swiglu else fs) + fs) * h // tp + (h if moe.shared_expert_gate else 0)
    f = moe.ffn_hidden_size
    return dense, moe.num_experts // ep * ((2 * f if shape.swiglu else f) + f) * h // etp


def routed_rows(shape: GPTConfig, tokens: float) -> float:
    """The (token, expert) rows a rank's ``tokens`` send to the experts (see module doc)."""
    moe = shape.moe
    k, E = moe.router_topk, moe.num_experts
    if moe.capacity_factor is None:
        return tokens * k
    capacity = math.ceil(tokens * k / E * moe.capacity_factor)
    if moe.pad_to_capacity:
        return E * min(capacity, tokens)
    return min(tokens * k, E * capacity)


def moe_activation_delta(shape: GPTConfig, s: int, b: int, tp: int, sp: bool, etp: int) -> float:
    """Bytes an MoE layer keeps beyond the dense MLP's share (2-byte activations, one micro-batch)."""
    moe, h = shape.moe, shape.hidden_size
    sbh, f = s * b * h, moe.ffn_hidden_size
    u = 2 * f if shape.swiglu else f
    dense_mlp = 19 * sbh / tp if sp else sbh * (3 + 16 / tp)
    rows = routed_rows(shape, s * b / tp)
    kept = 3 * sbh / (tp if sp else 1) + rows * (2 * h * etp + 2 * u + 2 * f + 2 * h)
    fs = moe.shared_expert_intermediate_size
    if fs:
        kept += 2 * s * b * ((2 * fs if shape.swiglu else fs) + fs) / tp
    return kept - dense_mlp


def moe_chunk_activation_bytes(shape: GPTConfig, layers: list[int], s: int, b: int, tp: int, sp: bool, etp: int,
                               recompute: str | None, method: str | None,
                               num_layers: int | None) -> tuple[float, float]:
    """(kept, transient) bytes the MoE layers among a chunk's global ``layers`` add to the dense
    figure: :func:`moe_activation_delta` each where it is kept; with full recompute only in the
    block being recomputed (``uniform``: blocks of ``num_layers``; ``block``: the first
    ``num_layers`` layers recompute, one at a time, the rest keep everything)."""
    moe = [shape.moe is not None and shape.moe.is_moe(n) for n in layers]
    if not any(moe):
        return 0.0, 0.0
    delta = moe_activation_delta(shape, s, b, tp, sp, etp)
    if recompute != "full":
        return sum(moe) * delta, 0.0
    n = max(1, min(num_layers or 1, len(layers)))
    if method == "block":
        return sum(moe[n:]) * delta, delta * any(moe[:n])
    return 0.0, delta * max(sum(moe[i:i + n]) for i in range(0, len(moe), n))


def dispatch_bytes(shape: GPTConfig, tokens: float, ep: int, etp: int, act_bytes: int = 2,
                   recompute_full: bool = False) -> float:
    """Bytes one rank sends for one MoE layer and micro-batch, forward and backward (see module doc)."""
    moe, h = shape.moe, shape.hidden_size
    exchanges = 6 if recompute_full else 4
    if moe.token_dispatcher == "allgather":
        return exchanges * (ep * etp - 1) * tokens * h * act_bytes
    rows = routed_rows(shape, tokens)
    return exchanges * rows * h * act_bytes * ((ep - 1) / ep + (etp - 1))


def dispatch_rows_per_direction(shape: GPTConfig, tokens: float, ep: int, etp: int = 1) -> float:
    """Rows a rank sends to other ranks in one dispatch (the all-to-all's, or the all-gather's):
    what ``MoELayer.stats["sent_rows"]`` measures, expected under balanced routing."""
    if shape.moe.token_dispatcher == "allgather":
        return (ep * etp - 1) * tokens
    return routed_rows(shape, tokens) * (ep - 1) / ep
