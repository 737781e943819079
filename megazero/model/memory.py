"""A GPT layout's memory and communication, by formula (the planner's arithmetic).

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` and the layout sizes: no process
group, no tensors. :mod:`megazero.planner` tries every layout with it; the flags' checks
(:mod:`megazero.config`) use it for the size of a checkpoint and a refused offload's figure.

**Parameters per rank (Φ)** -- this rank's TP slice of its pipeline stage: per layer
``2 n_h + (H + 2G) d h / t + H d h / t + k f h / t`` weights (norm weights, QKV, dense, MLP with
``k = 3`` for SwiGLU else 2; ``n_h = 2h`` with LayerNorm, ``h`` with RMSNorm) plus biases
``(H + 2G) d / t + h + k' f / t + h`` (``k' = 2`` SwiGLU else 1); the first stage adds the word
embedding ``V' h / t`` (V' = vocab padded to a multiple of 128 t) and learned positions
``P h``; the last stage adds the final norm and, when the embedding is untied or PP > 1 (the
last stage keeps a tied copy), the output layer ``V' h / t``.

**Model states (ZeRO)**, N = DP, bytes per parameter: p (params: 2 with --fp16/--bf16, else 4),
g (grads: 4 with --bf16, fp32 or --accumulate-allreduce-grads-in-fp32, else 2), 12 (fp32
master + Adam m and v)::

    stage 0   (p + g + 12) Φ             --fp16: 16 Φ
    stage 1   (p + g) Φ + 12 Φ / N               4 Φ + 12 Φ / N
    stage 2   p Φ + (g + 12) Φ / N               2 Φ + 14 Φ / N
    stage 3   (p + g + 12) Φ / N                 16 Φ / N

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"), bytes per layer per micro-batch, s sequence, b micro-batch, h hidden,
a heads, t = TP (x2 in fp32)::

    no recompute, no SP     s b h (10 + 24/t + 5 a s / (h t))
    no recompute, SP        s b h (34 + 5 a s / h) / t
    selective, no SP        s b h (10 + 24/t)
    selective, SP           34 s b h / t
    full                    2 s b h  (/t with SP) stored per recomputed block of
                            --recompute-num-layers layers, plus one block's full activations
                            live while it is recomputed

A pipeline rank r holds ``in_flight(r)`` chunk-activations of L / (PP VP) layers each:
``min(PP - r, M)`` with 1F1B (PP micro-batches on the first stage: L layers' worth, as without
PP), ``min(2 (PP - r - 1) + (VP - 1) PP + 1, M VP)`` interleaved (the first stage:
``L (1 + (PP - 1) / (PP VP))`` layers' worth), 1 without pipelining
(:func:`megazero.pipeline.plan.in_flight_bound`). The first stage adds the embedding dropout mask
``s b h`` (/t with SP) per in-flight micro-batch, the last the output terms ``4 s b h / t + 4 s b V' / t``
(final-norm and projection inputs, fp32 logits for the cross entropy).

**Communication per step** (bytes each rank sends, ring-equivalent: all-reduce of X over n ranks
``2 (n-1)/n X``, reduce-scatter or all-gather ``(n-1)/n X``), as megazero issues it::

    DP  stage 0: AR(g Φ)   1: RS(g Φ) + AG(p Φ)   2: M RS(g Φ) + AG(p Φ)   3: M (2 AG(p Φ) + RS(g Φ))
    TP  per micro-batch and layer 4 AR(s b h A) (6 with full recompute; SP's AG/RS pairs are equal)
    PP  per micro-batch 2 VP s b h A (/t with SP): activations forward, gradients backward

(A = activation bytes, 2 or 4.) A layout's figures are those of its most loaded pipeline stage
(largest total memory). Not counted: CUDA context and allocator fragmentation, communication
buckets, ZeRO-3's gathered working set (a layer or two of full parameters), temporaries of the
largest kernels. Leave ~10-20 % of the device for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megazero.model.config import GPTConfig

GiB = 2 ** 30


# ---- parameters ------------------------------------------------------------------------------
def norm_params(shape: GPTConfig) -> int:
    return 2 * shape.hidden_size if shape.layernorm else shape.hidden_size


def layer_params(shape: GPTConfig, tp: int = 1) -> int:
    """One transformer layer's parameters on one TP rank (norms and row-parallel biases whole)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    up = 2 * f if shape.swiglu else f
    weights = (q + 2 * kv) * h // tp + q * h // tp + up * h // tp + f * h // tp
    biases = ((q + 2 * kv) // tp + h + up // tp + h) if shape.add_bias_linear else 0
    return weights + biases + 2 * norm_params(shape)


def embedding_params(shape: GPTConfig, tp: int = 1) -> int:
    positions = shape.max_position_embeddings * shape.hidden_size if shape.learned_positions else 0
    return shape.padded_vocab(tp) // tp * shape.hidden_size + positions


def head_params(shape: GPTConfig, tp: int = 1, pp: int = 1) -> int:
    """Final norm, plus the output layer when untied or on a last stage that is not the first."""
    output = shape.padded_vocab(tp) // tp * shape.hidden_size if (not shape.tied_embeddings or pp > 1) else 0
    return norm_params(shape) + output


def stage_params(shape: GPTConfig, tp: int, pp: int, rank: int) -> int:
    """Φ of pipeline rank ``rank``: L/PP layers, the embedding on the first, the head on the last."""
    phi = shape.num_layers // pp * layer_params(shape, tp)
    if rank == 0:
        phi += embedding_params(shape, tp)
    if rank == pp - 1:
        phi += head_params(shape, tp, pp)
    return phi


def total_params(shape: GPTConfig) -> int:
    """The whole model (TP = PP = 1), padded vocabulary included."""
    return stage_params(shape, 1, 1, 0)


# ---- model states --------------------------------------------------------------------------
def model_state_bytes(phi: float, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                      optim_bytes: int = 12) -> float:
    """ZeRO model states per rank; defaults give 16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N."""
    p, g, k, n = param_bytes, grad_bytes, optim_bytes, dp
    return {0: (p + g + k) * phi, 1: (p + g) * phi + k * phi / n,
            2: p * phi + (g + k) * phi / n, 3: (p + g + k) * phi / n}[stage]


# ---- activations ---------------------------------------------------------------------------
def layer_activation_bytes(s: int, b: int, h: int, a: int, tp: int, sp: bool = False,
                           recompute: str | None = None) -> float:
    """Korthikanti et al.: bytes one layer keeps for one micro-batch (2-byte activations).

    ``recompute``: None, ``selective`` or ``full`` (full: only the layer input, 2 s b h).
    """
    sbh, t = s * b * h, tp
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def chunk_activation_bytes(layers: int, s: int, b: int, h: int, a: int, tp: int, sp: bool,
                           recompute: str | None, method: str | None, num_layers: int | None) -> tuple[float, float]:
    """(kept, transient) bytes of one model chunk of ``layers`` layers for one micro-batch.

    Full recompute, ``uniform``: the input of every block of ``num_layers`` layers is kept;
    ``block``: the first ``num_layers`` layers keep only their input, the rest everything.
    The transient is one block recomputing its full activations during the backward.
    """
    full = layer_activation_bytes(s, b, h, a, tp, sp)
    if recompute != "full":
        return layers * layer_activation_bytes(s, b, h, a, tp, sp, recompute), 0.0
    n = max(1, min(num_layers or 1, layers))
    stored = layer_activation_bytes(s, b, h, a, tp, sp, "full")
    if method == "block":
        return n * stored + (layers - n) * full, full
    return math.ceil(layers / n) * stored, n * full


# ---- one layout ----------------------------------------------------------------------------
@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    vp: int = 1
    micro_batches: int = 1
    stage: int = 0              # the pipeline rank reported (most memory)
    params: int = 0             # Φ of that rank
    model_state_bytes: float = 0.0
    activation_bytes: float = 0.0
    total_bytes: float = 0.0
    comm_dp_bytes: float = 0.0
    comm_tp_bytes: float = 0.0
    comm_pp_bytes: float = 0.0
    fits: bool = False

    @property
    def comm_bytes(self) -> float:
        return self.comm_dp_bytes + self.comm_tp_bytes + self.comm_pp_bytes


def _ar(x, n):
    return 2 * (n - 1) / n * x


def _rs(x, n):
    return (n - 1) / n * x


def estimate(shape: GPTConfig, tp: int, pp: int, dp: int, zero: int, *, micro_batch_size: int, micro_batches: int,
             vp: int = 1, param_bytes: int = 2, grad_bytes: int = 2, sequence_parallel: bool = False,
             recompute: str | None = None, recompute_method: str | None = None,
             recompute_num_layers: int | None = None, gpu_memory_gb: float = 80.0) -> Layout:
    """Memory and communication of one layout, at its most loaded pipeline stage."""
    from megazero.pipeline.plan import in_flight_bound
    s, b, h, a = shape.seq_length, micro_batch_size, shape.hidden_size, shape.num_attention_heads
    sp = sequence_parallel and tp > 1
    act_scale = 2 if param_bytes == 4 else 1  # the formulas count 2-byte activations
    m, v, L = micro_batches, vp, shape.num_layers
    V = shape.padded_vocab(tp)
    kept, transient = chunk_activation_bytes(L // (pp * v), s, b, h, a, tp, sp, recompute, recompute_method,
                                             recompute_num_layers)
    best = None
    for r in range(pp):
        phi = stage_params(shape, tp, pp, r)
        states = model_state_bytes(phi, zero, dp, param_bytes, grad_bytes)
        k = in_flight_bound(pp, v, m, r)
        act = k * kept + transient
        if r == 0:
            act += min(-(-k // v), m) * s * b * h / (tp if sp else 1)
        if r == pp - 1:
            act += 4 * s * b * h / tp + 4 * s * b * V / tp
        act *= act_scale
        if best is None or states + act > best.total_bytes:
            best = Layout(tp, pp, dp, zero, v, m, r, phi, states, act, states + act)
    phi = best.params
    if dp > 1:
        gp, pb = grad_bytes * phi, param_bytes * phi
        best.comm_dp_bytes = {0: _ar(gp, dp), 1: _rs(gp, dp) + _rs(pb, dp), 2: m * _rs(gp, dp) + _rs(pb, dp),
                              3: m * (2 * _rs(pb, dp) + _rs(gp, dp))}[zero]
    A = 2 * act_scale
    if tp > 1:
        per_layer = (6 if recompute == "full" else 4) * _ar(s * b * h * A, tp)
        best.comm_tp_bytes = m * (L // pp) * per_layer
    if pp > 1:
        best.comm_pp_bytes = m * 2 * v * s * b * h * A / (tp if sp else 1)
    best.fits = best.total_bytes <= gpu_memory_gb * GiB
    return best
