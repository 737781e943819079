"""Per-layer activations by formula, and what context parallelism changes in a layout's memory and
communication (the planner's arithmetic; :mod:`megazero.planner.memory` composes them; docs/plan.md).

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` and sizes: no process group, no
tensors.

**Per-layer activations** (Korthikanti et al. 2022, :func:`layer_activation_bytes`), bytes one
layer keeps for one micro-batch of ``s`` tokens, ``b`` micro-batch, ``h`` hidden, ``a`` heads,
``t = TP``, 2-byte activations (x2 in fp32)::

    no recompute   s b h (10 + 24/t + 5 a s / (h t))     SP: s b h (34 + 5 a s / h) / t
    selective      s b h (10 + 24/t)                     SP: 34 s b h / t
    full           2 s b h (/t with SP) per recomputed block, plus one block's activations while
                   it is recomputed (:func:`chunk_activation_bytes`)

**Context parallelism** (``CP`` ranks, :mod:`megazero.context_parallel.ring`, :mod:`~megazero.context_parallel.ulysses`). A rank holds
``s' = s / CP`` tokens of each sequence, so every per-token figure -- the layers' activations,
the embedding's masks, the logits, the TP, PP and expert-dispatch traffic -- is the CP 1 figure
at ``s'``. The attention (CP needs attention dropout 0) keeps no ``a s^2`` scores, whether the
ring's blocks or SDPA's fused kernels after the all-to-all: without recompute a layer keeps the
selective figure at ``s'`` (selective recompute has nothing more to drop: the layer does not
checkpoint a CP attention), plus what the attention saves for its backward
(:func:`cp_attention_kept_bytes`; ``a/t`` heads on the rank, head size ``d``, ``A`` activation
bytes)::

    p2p   4 b (a/t) s' (d + 1)      the fp32 output o and log-sum-exp (RingAttention's accumulators)
    a2a   b (a/t) s' (A d + 4)      SDPA's output and fp32 log-sum-exp

The ring's backward works on one layer at a time in fp32 -- a transient
(:func:`ring_transient_bytes`): about 12 ``[b, a/t, s', d]`` tensors (fp32 dQ, dO and Q, the
expanded K/V and their block gradients, dK/dV riding the ring and the received ones, the next
K/V) and at most two score tiles: the ring computes scores in query-row tiles of at most
``T = 2^22`` elements (``TILE_ELEMS``; one query row of a ``L = s' / 2`` chunk at least)::

    4 b (a/t) s' d 12 + 2 x 4 b (a/t) L r,    r = max(1, min(L, T // (b (a/t) L))) rows per tile

(measured on CPU with a one-process ring: 9 (fp32) to 12 (bf16) such tensors with MHA, fewer
with GQA, and up to two tiles; the forward holds less). With full recompute the saved terms
live only in the block being recomputed.

**Model states**: CP ranks hold the same parameters and reduce their gradients together, so
ZeRO partitions the dense states over DP x CP and the experts' over EDP = TP CP DP / (ETP EP).

**Attention traffic** (:func:`cp_attention_bytes`), bytes each rank sends per layer and
micro-batch, ``B = b (G/t) s' d`` elements (one rank's K or V; ``G`` query groups, ``H`` heads)::

    p2p   forward   (CP - 1) 2 B A                   CP - 1 ring steps of (K, V)
          backward  (CP - 1) 2 B A + CP 2 B 4        K, V ahead again (CP - 1 steps); the fp32 dK, dV
                                                     follow their block, CP steps (the last one home)
    a2a   forward   (CP - 1)/CP b s' d (2H + 2G)/t A  all-to-alls of q, k, v and the output
          backward  the same                         their inverses on the gradients

Full recompute replays the forward (the ring's K/V steps, the four all-to-alls). Per step:
M x the stage's layers x that.
"""

from __future__ import annotations

import math

from megazero.model.config import GPTConfig, replace_config

ACC_BYTES = 4        # the ring's accumulation dtype: fp32
RING_ROWS = 12       # fp32 [b, a/t, s', d] tensors the ring's backward holds at once (module doc)
RING_TILES, TILE_ELEMS = 2, 1 << 22  # score tiles alive at once, elements per tile (context_parallel's)


# ---- per-layer activations -----------------------------------------------------------------
def layer_activation_bytes(s: int, b: int, h: int, a: int, tp: int, sp: bool = False,
                           recompute: str | None = None, scores: bool = True) -> float:
    """Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*):
    bytes one layer keeps for one micro-batch (2-byte activations), t = TP::

        no recompute    s b h (10 + 24/t + 5 a s/(h t))     with SP: s b h (34 + 5 a s/h) / t
        selective       s b h (10 + 24/t)                   with SP: 34 s b h / t
        full            2 s b h (the layer input)           with SP: 2 s b h / t

    ``5 a s/h``: the softmax output, its dropout mask and output (``a s^2 b`` each, 2 + 1 + 2 bytes).
    ``scores=False``: the attention keeps none of them -- a flash or fused kernel, or CP's -- so
    None is the selective figure.
    """
    sbh, t = s * b * h, tp
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective" or not scores:
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def chunk_activation_bytes(layers: int, s: int, b: int, h: int, a: int, tp: int, sp: bool,
                           recompute: str | None, method: str | None, num_layers: int | None,
                           scores: bool = True) -> tuple[float, float]:
    """(kept, transient) bytes of one model chunk of ``layers`` layers for one micro-batch.

    Full recompute, ``uniform``: the input of every block of ``num_layers`` layers is kept;
    ``block``: the first ``num_layers`` layers keep only their input, the rest everything.
    The transient is one block recomputing its full activations during the backward.
    """
    full = layer_activation_bytes(s, b, h, a, tp, sp, scores=scores)
    if recompute != "full":
        return layers * layer_activation_bytes(s, b, h, a, tp, sp, recompute, scores), 0.0
    n = max(1, min(num_layers or 1, layers))
    stored = layer_activation_bytes(s, b, h, a, tp, sp, "full")
    if method == "block":
        return n * stored + (layers - n) * full, full
    return math.ceil(layers / n) * stored, n * full


# ---- context parallelism -------------------------------------------------------------------
def check_cp_layout(shape: GPTConfig, cp: int, tp: int, sp: bool = False) -> None:
    """Raise ``ValueError`` unless ``cp`` ranks can split this model's sequence at TP ``tp``
    (:meth:`GPTConfig.check_cp`'s shape conditions: the sequence in 2 CP chunks for the ring, CP for
    a2a, x TP with SP; a2a: heads and query groups per TP rank divisible by CP). Attention dropout,
    which CP refuses too, is no layout's matter: the planner's command line refuses it."""
    if cp > 1:
        replace_config(shape, attention_dropout=0.0, sequence_parallel=sp).check_cp(cp, tp)


def cp_valid(shape: GPTConfig, cp: int, tp: int, sp: bool = False) -> bool:
    """Whether :func:`check_cp_layout` passes (the planner skips the layouts where it does not)."""
    try:
        check_cp_layout(shape, cp, tp, sp)
    except ValueError:
        return False
    return True


def cp_attention_kept_bytes(shape: GPTConfig, s_local: int, b: int, tp: int, cp: int, act_bytes: int) -> float:
    """Bytes a CP attention saves for its backward beyond the selective figure, per layer and
    micro-batch of ``s_local`` tokens per rank (module doc); 0 at CP 1."""
    if cp == 1:
        return 0.0
    rows, d = b * shape.num_attention_heads // tp * s_local, shape.kv_channels
    return rows * (ACC_BYTES * (d + 1) if shape.cp_comm_type == "p2p" else act_bytes * d + ACC_BYTES)


def ring_transient_bytes(shape: GPTConfig, s_local: int, b: int, tp: int) -> float:
    """The ring's backward working set for one layer (module doc): 12 fp32 ``[b, a/t, s', d]``
    tensors and two score tiles of at most ``TILE_ELEMS`` elements (one query row at least)."""
    L, heads = s_local // 2, b * shape.num_attention_heads // tp
    tile = heads * L * max(1, min(L, TILE_ELEMS // (heads * L)))  # query rows per tile x L keys
    return ACC_BYTES * (RING_ROWS * heads * s_local * shape.kv_channels + RING_TILES * tile)


def cp_chunk_activation_bytes(shape: GPTConfig, layers: int, s_local: int, b: int, tp: int, cp: int,
                              act_bytes: int, recompute: str | None, method: str | None,
                              num_layers: int | None) -> tuple[float, float]:
    """(kept, transient) bytes (real, not 2-byte units) a chunk of ``layers`` layers adds under CP:
    :func:`cp_attention_kept_bytes` per layer where kept (with full recompute: in the block being
    recomputed), and the ring's :func:`ring_transient_bytes`."""
    if cp == 1:
        return 0.0, 0.0
    per = cp_attention_kept_bytes(shape, s_local, b, tp, cp, act_bytes)
    ring = ring_transient_bytes(shape, s_local, b, tp) if shape.cp_comm_type == "p2p" else 0.0
    if recompute != "full":
        return layers * per, ring
    n = max(1, min(num_layers or 1, layers))
    if method == "block":
        return (layers - n) * per, per + ring
    return 0.0, n * per + ring


def ring_bytes(shape: GPTConfig, s_local: int, b: int, tp: int, cp: int, act_bytes: int = 2,
               recompute_full: bool = False) -> float:
    """Bytes one rank sends in the ring attention for one layer and micro-batch (module doc)."""
    block = b * shape.num_query_groups // tp * s_local * shape.kv_channels
    kv = (cp - 1) * 2 * block * act_bytes  # forward, again in backward (and in a recompute)
    return kv * (3 if recompute_full else 2) + cp * 2 * block * ACC_BYTES


def ulysses_bytes(shape: GPTConfig, s_local: int, b: int, tp: int, cp: int, act_bytes: int = 2,
                  recompute_full: bool = False) -> float:
    """Bytes one rank sends in the Ulysses all-to-alls for one layer and micro-batch (module doc)."""
    heads = (2 * shape.num_attention_heads + 2 * shape.num_query_groups) // tp  # q, output; k, v
    forward = (cp - 1) / cp * b * s_local * shape.kv_channels * heads * act_bytes
    return forward * (3 if recompute_full else 2)


def cp_attention_bytes(shape: GPTConfig, s_local: int, b: int, tp: int, cp: int, act_bytes: int = 2,
                       recompute_full: bool = False) -> float:
    """The CP attention's bytes per rank, layer and micro-batch for ``shape.cp_comm_type``; 0 at CP 1."""
    if cp == 1:
        return 0.0
    fn = ring_bytes if shape.cp_comm_type == "p2p" else ulysses_bytes
    return fn(shape, s_local, b, tp, cp, act_bytes, recompute_full)
