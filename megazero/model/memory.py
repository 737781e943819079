"""A GPT layout's memory and communication, by formula (the planner's arithmetic; docs/plan.md).

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` and the layout sizes: no process
group, no tensors. :mod:`megazero.planner` tries every layout with it; the flags' checks
(:mod:`megazero.config`) use it for the size of a checkpoint and a refused offload's figure.

**Parameters per rank (Φ)** -- this rank's TP slice of its pipeline stage: per layer
``2 n_h + (H + 2G) d h / t + H d h / t + k f h / t`` weights (norms ``n_h = 2h`` LayerNorm or
``h`` RMSNorm, QKV, dense, MLP with ``k = 3`` SwiGLU else 2) plus biases
``(H + 2G) d / t + h + k' f / t + h`` (``k' = 2`` SwiGLU else 1); the first stage adds the word
embedding ``V' h / t`` (V' padded to a multiple of 128 t) and learned positions ``P h``; the last
the final norm and, untied or PP > 1, the output layer ``V' h / t``. An MoE layer
(``--moe-layer-freq``) has the attention and norms, the router ``E h``, the shared expert
(an MLP over TP) and its gate ``h`` -- dense -- and ``E / EP`` routed experts of ``k f_e h / ETP``
each -- expert Φ_e.

**Model states (ZeRO)**, N = DP, bytes per parameter p (2 with --fp16/--bf16, else 4), g (4
with --bf16, fp32 or --accumulate-allreduce-grads-in-fp32, else 2), 12 (fp32 master, Adam m, v)::

    stage 0 (p + g + 12) Φ    1: (p + g) Φ + 12 Φ / N    2: p Φ + (g + 12) Φ / N    3: (p + g + 12) Φ / N

Expert states are the same with Φ_e and N = EDP = TP DP / (ETP EP) (the expert-DP group).

**Activations** (Korthikanti et al. 2022), bytes per layer per micro-batch, s sequence, b
micro-batch, h hidden, a heads, t = TP (x2 in fp32)::

    no recompute   s b h (10 + 24/t + 5 a s / (h t))     SP: s b h (34 + 5 a s / h) / t
    selective      s b h (10 + 24/t)                     SP: 34 s b h / t
    full           2 s b h (/t with SP) per recomputed block of --recompute-num-layers layers,
                   plus one block's full activations while it is recomputed

An MoE layer keeps its routed rows instead of the dense MLP's share
(:mod:`megazero.model.expert_memory`). A pipeline rank r holds ``in_flight(r)`` chunk-activations
(:func:`megazero.pipeline.plan.in_flight_bound`: ``min(PP - r, M)`` with 1F1B,
``min(2 (PP - r - 1) + (VP - 1) PP + 1, M VP)`` interleaved, 1 without pipelining); the first
stage adds the embedding dropout mask ``s b h`` (/t with SP) per in-flight micro-batch, the last
``4 s b h / t + 4 s b V' / t`` (final-norm and projection inputs, fp32 logits).

**Communication per step** (bytes each rank sends, ring-equivalent: all-reduce of X over n ranks
``2 (n-1)/n X``, reduce-scatter or all-gather ``(n-1)/n X``), as megazero issues it::

    DP  stage 0: AR(g Φ)   1: RS(g Φ) + AG(p Φ)   2: M RS(g Φ) + AG(p Φ)   3: M (2 AG(p Φ) + RS(g Φ))
    EDP the same for Φ_e over the EDP ranks
    TP  per micro-batch and layer 4 AR(s b h A) (6 with full recompute; SP's AG/RS pairs are equal;
        an MoE layer without a shared expert: the attention's half)
    PP  per micro-batch 2 VP s b h A (/t with SP): activations forward, gradients backward
    EP  per micro-batch and MoE layer: the dispatcher's (:mod:`megazero.model.expert_memory`)

(A = activation bytes, 2 or 4.) A layout's figures are those of its most loaded pipeline stage
(largest total memory). Not counted: CUDA context and allocator fragmentation, communication
buckets, ZeRO-3's gathered working set (a layer or two of full parameters), temporaries of the
largest kernels. Leave ~10-20 % of the device for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megazero.model.config import GPTConfig

from .expert_memory import dispatch_bytes, expert_data_parallel, moe_block_params, moe_chunk_activation_bytes

GiB = 2 ** 30


# ---- parameters ------------------------------------------------------------------------------
def norm_params(shape: GPTConfig) -> int:
    return 2 * shape.hidden_size if shape.layernorm else shape.hidden_size


def attention_params(shape: GPTConfig, tp: int = 1) -> int:
    """QKV and the dense projection on one TP rank (row-parallel bias whole)."""
    h, d = shape.hidden_size, shape.kv_channels
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    biases = ((q + 2 * kv) // tp + h) if shape.add_bias_linear else 0
    return (q + 2 * kv) * h // tp + q * h // tp + biases


def mlp_params(shape: GPTConfig, tp: int = 1) -> int:
    """The dense MLP on one TP rank."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    up = 2 * f if shape.swiglu else f
    return up * h // tp + f * h // tp + ((up // tp + h) if shape.add_bias_linear else 0)


def layer_params(shape: GPTConfig, tp: int = 1) -> int:
    """One dense transformer layer's parameters on one TP rank (norms and row-parallel biases whole)."""
    return attention_params(shape, tp) + mlp_params(shape, tp) + 2 * norm_params(shape)


def embedding_params(shape: GPTConfig, tp: int = 1) -> int:
    positions = shape.max_position_embeddings * shape.hidden_size if shape.learned_positions else 0
    return shape.padded_vocab(tp) // tp * shape.hidden_size + positions


def head_params(shape: GPTConfig, tp: int = 1, pp: int = 1) -> int:
    """Final norm, plus the output layer when untied or on a last stage that is not the first."""
    output = shape.padded_vocab(tp) // tp * shape.hidden_size if (not shape.tied_embeddings or pp > 1) else 0
    return norm_params(shape) + output


def stage_layers(shape: GPTConfig, pp: int, rank: int, vp: int = 1) -> list[int]:
    """The global layers of pipeline rank ``rank``: its VP chunks ``c PP + rank`` in order."""
    per = shape.num_layers // (pp * vp)
    return [n for c in range(vp) for n in range((c * pp + rank) * per, (c * pp + rank + 1) * per)]


def stage_param_split(shape: GPTConfig, tp: int, pp: int, rank: int, vp: int = 1, ep: int = 1,
                      etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) Φ of pipeline rank ``rank``: its layers (MoE ones per ``--moe-layer-freq``),
    the embedding on the first, the head on the last; experts sharded over EP x expert TP."""
    layers = stage_layers(shape, pp, rank, vp)
    moe_layers = sum(shape.moe.is_moe(n) for n in layers) if shape.moe is not None else 0
    dense, expert = (len(layers) - moe_layers) * layer_params(shape, tp), 0
    if moe_layers:
        d, e = moe_block_params(shape, tp, ep, tp if etp is None else etp)
        dense += moe_layers * (attention_params(shape, tp) + 2 * norm_params(shape) + d)
        expert = moe_layers * e
    if rank == 0:
        dense += embedding_params(shape, tp)
    if rank == pp - 1:
        dense += head_params(shape, tp, pp)
    return dense, expert


def stage_params(shape: GPTConfig, tp: int, pp: int, rank: int, vp: int = 1, ep: int = 1,
                 etp: int | None = None) -> int:
    """Φ of pipeline rank ``rank``: L/PP layers, the embedding on the first, the head on the last
    (with MoE layers: this rank's share of the experts, :func:`stage_param_split`)."""
    return sum(stage_param_split(shape, tp, pp, rank, vp, ep, etp))


def total_params(shape: GPTConfig) -> int:
    """The whole model (TP = PP = EP = 1), padded vocabulary and every expert included."""
    return stage_params(shape, 1, 1, 0)


def active_params(shape: GPTConfig) -> int:
    """Parameters one token passes through: the dense ones and ``k`` of the ``E`` routed experts."""
    dense, expert = stage_param_split(shape, 1, 1, 0)
    return dense + (expert * shape.moe.router_topk // shape.moe.num_experts if shape.moe is not None else 0)


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
    params: int = 0             # Φ of that rank (dense + expert)
    model_state_bytes: float = 0.0
    activation_bytes: float = 0.0
    total_bytes: float = 0.0
    comm_dp_bytes: float = 0.0
    comm_tp_bytes: float = 0.0
    comm_pp_bytes: float = 0.0
    fits: bool = False
    ep: int = 1                 # MoE: expert parallel, expert TP, expert data parallel (TP DP / (ETP EP))
    etp: int = 1
    edp: int = 1
    expert_params: int = 0      # the routed experts' part of ``params``
    comm_edp_bytes: float = 0.0  # expert gradients (and ZeRO gathers) over EDP
    comm_ep_bytes: float = 0.0   # the token dispatcher

    @property
    def comm_bytes(self) -> float:
        return self.comm_dp_bytes + self.comm_tp_bytes + self.comm_pp_bytes + self.comm_edp_bytes + self.comm_ep_bytes


def _ar(x, n):
    return 2 * (n - 1) / n * x


def _rs(x, n):
    return (n - 1) / n * x


@dataclass(frozen=True)
class _Run:
    """The settings of one estimate that the formulas share."""
    s: int
    b: int
    tp: int
    pp: int
    vp: int
    m: int
    sp: bool
    recompute: str | None
    method: str | None
    num_layers: int | None
    etp: int


def _chunk_bytes(shape: GPTConfig, layers: list[int], run: _Run) -> tuple[float, float]:
    """(kept, transient) of one chunk holding global ``layers``, MoE layers' routed rows included."""
    kept, transient = chunk_activation_bytes(len(layers), run.s, run.b, shape.hidden_size, shape.num_attention_heads,
                                             run.tp, run.sp, run.recompute, run.method, run.num_layers)
    extra = moe_chunk_activation_bytes(shape, layers, run.s, run.b, run.tp, run.sp, run.etp, run.recompute,
                                       run.method, run.num_layers)
    return kept + extra[0], transient + extra[1]


def _rank_activation_bytes(shape: GPTConfig, r: int, run: _Run) -> float:
    """Pipeline rank ``r``'s activations (2-byte units): its in-flight chunk-activations (the most
    loaded of its chunks), the embedding's dropout masks on the first, the output terms on the last."""
    from megazero.pipeline.plan import in_flight_bound
    s, b, h, tp = run.s, run.b, shape.hidden_size, run.tp
    layers = stage_layers(shape, run.pp, r, run.vp)
    per = len(layers) // run.vp
    chunks = [_chunk_bytes(shape, layers[c * per:(c + 1) * per], run) for c in range(run.vp)]
    kept, transient = max(c[0] for c in chunks), max(c[1] for c in chunks)
    k = in_flight_bound(run.pp, run.vp, run.m, r)
    act = k * kept + transient
    if r == 0:
        act += min(-(-k // run.vp), run.m) * s * b * h / (tp if run.sp else 1)
    if r == run.pp - 1:
        act += 4 * s * b * h / tp + 4 * s * b * shape.padded_vocab(tp) / tp
    return act


def _zero_comm(phi: float, n: int, zero: int, m: int, p: int, g: int) -> float:
    if n <= 1 or not phi:
        return 0.0
    gp, pb = g * phi, p * phi
    return {0: _ar(gp, n), 1: _rs(gp, n) + _rs(pb, n), 2: m * _rs(gp, n) + _rs(pb, n),
            3: m * (2 * _rs(pb, n) + _rs(gp, n))}[zero]


def _communication(x: Layout, shape: GPTConfig, run: _Run, A: int, param_bytes: int, grad_bytes: int) -> None:
    """Fill ``x``'s communication per step: dense states over DP, experts' over EDP, TP (an MoE
    layer without a shared expert has only the attention's half), PP, and the dispatcher."""
    s, b, h, tp, m = run.s, run.b, shape.hidden_size, run.tp, run.m
    x.comm_dp_bytes = _zero_comm(x.params - x.expert_params, x.dp, x.zero, m, param_bytes, grad_bytes)
    x.comm_edp_bytes = _zero_comm(x.expert_params, x.edp, x.zero, m, param_bytes, grad_bytes)
    layers = stage_layers(shape, run.pp, x.stage, run.vp)
    moe_layers = sum(shape.moe.is_moe(n) for n in layers) if shape.moe is not None else 0
    if tp > 1:
        per_layer = (6 if run.recompute == "full" else 4) * _ar(s * b * h * A, tp)
        moe_share = 1.0 if moe_layers and shape.moe.shared_expert_intermediate_size else 0.5
        x.comm_tp_bytes = m * (len(layers) - moe_layers + moe_share * moe_layers) * per_layer
    if run.pp > 1:
        x.comm_pp_bytes = m * 2 * run.vp * s * b * h * A / (tp if run.sp else 1)
    if moe_layers:
        x.comm_ep_bytes = m * moe_layers * dispatch_bytes(shape, s * b / tp, x.ep, x.etp, A, run.recompute == "full")


def estimate(shape: GPTConfig, tp: int, pp: int, dp: int, zero: int, *, micro_batch_size: int, micro_batches: int,
             vp: int = 1, param_bytes: int = 2, grad_bytes: int = 2, sequence_parallel: bool = False,
             recompute: str | None = None, recompute_method: str | None = None,
             recompute_num_layers: int | None = None, gpu_memory_gb: float = 80.0, ep: int = 1,
             etp: int | None = None) -> Layout:
    """Memory and communication of one layout, at its most loaded pipeline stage. MoE: ``ep``
    experts-parallel ranks, ``etp`` expert TP (None: TP); expert states over EDP = TP DP / (ETP EP)."""
    etp = tp if etp is None else etp
    edp = expert_data_parallel(tp, dp, ep, etp)
    run = _Run(shape.seq_length, micro_batch_size, tp, pp, vp, micro_batches, sequence_parallel and tp > 1,
               recompute, recompute_method, recompute_num_layers, etp)
    act_scale = 2 if param_bytes == 4 else 1  # the formulas count 2-byte activations
    best = None
    for r in range(pp):
        dense, expert = stage_param_split(shape, tp, pp, r, vp, ep, etp)
        states = (model_state_bytes(dense, zero, dp, param_bytes, grad_bytes)
                  + model_state_bytes(expert, zero, edp, param_bytes, grad_bytes))
        act = _rank_activation_bytes(shape, r, run) * act_scale
        if best is None or states + act > best.total_bytes:
            best = Layout(tp, pp, dp, zero, vp, micro_batches, r, dense + expert, states, act, states + act,
                          ep=ep, etp=etp, edp=edp, expert_params=expert)
    _communication(best, shape, run, 2 * act_scale, param_bytes, grad_bytes)
    best.fits = best.total_bytes <= gpu_memory_gb * GiB
    return best
