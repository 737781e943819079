"""A GPT layout's memory and communication, by formula (the planner's arithmetic; docs/plan.md).

Pure arithmetic on a :class:`~megazero.model.config.GPTConfig` and the layout sizes: no process
group, no tensors. :mod:`megazero.planner` tries every layout with it; the flags' checks
(:mod:`megazero.config`) use it for the size of a checkpoint and a refused offload's figure.

**Parameters per rank (Φ)** -- this rank's TP slice of its pipeline stage: per layer
``2 n_h + (H + 2G) d h / t + H d h / t + k f h / t`` weights (norms ``n_h = 2h`` LayerNorm or
``h`` RMSNorm, QKV, dense, MLP with ``k = 3`` SwiGLU else 2) plus biases
``(H + 2G) d / t + h + k' f / t + h`` (``k' = 2`` SwiGLU else 1), or with ``--add-qkv-bias``
alone the QKV's ``(H + 2G) d / t``, with ``--qk-layernorm`` the q and k norms ``2 n_d`` (whole on
every TP rank: ``n_d = 2d`` LayerNorm or ``d`` RMSNorm); the first stage adds the word
embedding ``V' h / t`` (V' padded to a multiple of 128 t) and learned positions ``P h``; the last
the final norm and, untied or on a rank without the embedding, the output layer ``V' h / t``
(tied with the V of zbv/dualpipev, rank 0 holds both ends and one matrix). An MoE layer
(``--moe-layer-freq``) has the attention and norms, the router ``E h``, the shared expert
(an MLP over TP) and its gate ``h`` -- dense -- and ``E / EP`` routed experts of ``k f_e h / ETP``
each -- expert Φ_e.

**Model states (ZeRO)**, N = DP x CP, bytes per parameter p (2 with --fp16/--bf16, else 4), g (4
with --bf16, fp32 or --accumulate-allreduce-grads-in-fp32, else 2), 12 (fp32 master, Adam m, v)::

    stage 0 (p + g + 12) Φ    1: (p + g) Φ + 12 Φ / N    2: p Φ + (g + 12) Φ / N    3: (p + g + 12) Φ / N

Expert states are the same with Φ_e and N = EDP = TP CP DP / (ETP EP) (the expert-DP group).

**Activations** per layer and micro-batch: Korthikanti et al. 2022's figures
(:mod:`megazero.planner.cp_memory`); a flash or fused attention kernel keeps no ``5 a s^2 b`` scores. **Context parallelism** (CP ranks): s is a rank's ``s / CP``
tokens in every formula here; the CP attention keeps no ``a s^2`` scores but its output and
log-sum-exp, and the ring adds its fp32 working set as a transient (:mod:`~megazero.planner.cp_memory`).
MLA layers: their own parameters and attention activations (:mod:`megazero.planner.mla_memory`).
An MoE layer keeps its routed rows instead of the dense MLP's share
(:mod:`megazero.planner.expert_memory`). A pipeline rank r holds ``in_flight(r)`` chunk-activations
(:func:`megazero.pipeline.plan.in_flight_bound`: ``min(PP - r, M)`` with 1F1B,
``min(2 (PP - r - 1) + (VP - 1) PP + 1, M VP)`` interleaved, 1 without pipelining; the
zero-bubble schedules' bounds with ``--pipeline-schedule``, whose zbv/dualpipev put the embedding
and the head both on rank 0); the first stage adds the embedding dropout mask ``s b h`` (/t with SP) per in-flight micro-batch, the last
``4 s b h / t + 4 s b V' / t`` (final-norm and projection inputs, fp32 logits).

**Communication per step** (bytes each rank sends, ring-equivalent: all-reduce of X over n ranks
``2 (n-1)/n X``, reduce-scatter or all-gather ``(n-1)/n X``), as megazero issues it::

    DP  stage 0: AR(g Φ)   1: RS(g Φ) + AG(p Φ)   2: M RS(g Φ) + AG(p Φ)   3: M (2 AG(p Φ) + RS(g Φ)),
        over the DP x CP ranks; EDP the same for Φ_e over the EDP ranks
    TP  per micro-batch and layer 4 AR(s b h A) (6 with full recompute; SP's AG/RS pairs are equal;
        an MoE layer without a shared expert: the attention's half)
    PP  per micro-batch 2 VP s b h A (/t with SP): activations forward, gradients backward
    EP  per micro-batch and MoE layer: the dispatcher's (:mod:`megazero.planner.expert_memory`)
    CP  per micro-batch and layer: the ring's K/V (dK/dV) or the all-to-alls (:mod:`~megazero.planner.cp_memory`)

(A = activation bytes, 2 or 4.) A layout's figures are those of its most loaded pipeline stage
(largest total memory). Not counted: CUDA context and allocator fragmentation, communication
buckets, ZeRO-3's gathered working set (a layer or two of full parameters), temporaries of the
largest kernels. Leave ~10-20 % of the device for them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazero.model.config import GPTConfig

from .cp_memory import (chunk_activation_bytes, check_cp_layout, cp_attention_bytes, cp_chunk_activation_bytes,
                        layer_activation_bytes)  # noqa: F401 (the planner's names)
from .mtp_memory import mtp_activation_bytes, mtp_extra_params, mtp_layers
from .expert_memory import dispatch_bytes, expert_data_parallel, moe_block_params, moe_chunk_activation_bytes
from .mla_memory import mla_activation_delta, mla_attention_params

GiB = 2 ** 30


# ---- parameters ------------------------------------------------------------------------------
def norm_params(shape: GPTConfig) -> int:
    return 2 * shape.hidden_size if shape.layernorm else shape.hidden_size


def attention_params(shape: GPTConfig, tp: int = 1) -> int:
    """QKV and the dense projection on one TP rank (row-parallel bias whole; the QKV bias alone
    with ``--add-qkv-bias``), and the replicated per-head q/k norms with ``--qk-layernorm``."""
    if shape.multi_latent_attention:  # its own projections (and latent norms): .mla_memory
        return mla_attention_params(shape, tp)
    h, d = shape.hidden_size, shape.kv_channels
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    biases = ((q + 2 * kv) // tp if shape.qkv_bias else 0) + (h if shape.add_bias_linear else 0)
    qk_norms = 2 * (2 * d if shape.layernorm else d) if shape.qk_layernorm else 0
    return (q + 2 * kv) * h // tp + q * h // tp + biases + qk_norms


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


def stage_layers(shape: GPTConfig, pp: int, rank: int, vp: int = 1, schedule: str | None = None) -> list[int]:
    """The global layers of pipeline rank ``rank``: its VP chunks ``c PP + rank`` in order (the V of
    ``schedule`` zbv/dualpipev: stages ``rank`` and ``2 PP - 1 - rank``)."""
    from megazero.pipeline import chunk_layer_ranges, placement
    return [n for a, b in chunk_layer_ranges(shape.num_layers, pp, vp, rank, placement(schedule)) for n in range(a, b)]


def _ends(pp: int, rank: int, schedule: str | None) -> tuple[bool, bool]:
    """(holds the embedding, holds the head): ranks 0 and PP - 1, both rank 0 with the V."""
    from megazero.pipeline import placement
    return rank == 0, rank == (0 if placement(schedule) == "v" else pp - 1)


def stage_param_split(shape: GPTConfig, tp: int, pp: int, rank: int, vp: int = 1, ep: int = 1,
                      etp: int | None = None, schedule: str | None = None) -> tuple[int, int]:
    """(dense, expert) Φ of pipeline rank ``rank``: its layers (MoE ones per ``--moe-layer-freq``),
    the embedding on the first, the head on the last; experts sharded over EP x expert TP."""
    first, last = _ends(pp, rank, schedule)
    layers = stage_layers(shape, pp, rank, vp, schedule) + (mtp_layers(shape) if last else [])  # MTP: last stage
    moe_layers = sum(shape.moe.is_moe(n) for n in layers) if shape.moe is not None else 0
    dense, expert = (len(layers) - moe_layers) * layer_params(shape, tp), 0
    if moe_layers:
        d, e = moe_block_params(shape, tp, ep, tp if etp is None else etp)
        dense += moe_layers * (attention_params(shape, tp) + 2 * norm_params(shape) + d)
        expert = moe_layers * e
    dense += embedding_params(shape, tp) if first else 0
    # a tied head on the embedding's rank (PP 1, or the V's rank 0) multiplies by that weight: no copy
    dense += head_params(shape, tp, 1 if first else pp) + mtp_extra_params(shape, tp, pp) if last else 0
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
    cp: int = 1                 # context parallel (the sequence split; DP x CP share the ZeRO states)
    comm_cp_bytes: float = 0.0   # the CP attention: the ring's K/V blocks or the all-to-alls
    schedule: str | None = None  # --pipeline-schedule (None: 1f1b / interleaved-1f1b by VP)

    @property
    def comm_bytes(self) -> float:
        return (self.comm_dp_bytes + self.comm_tp_bytes + self.comm_pp_bytes + self.comm_edp_bytes + self.comm_ep_bytes
                + self.comm_cp_bytes)


def _ar(x, n):
    return 2 * (n - 1) / n * x


def _rs(x, n):
    return (n - 1) / n * x


@dataclass(frozen=True)
class _Run:
    """The settings of one estimate that the formulas share (``s``: a rank's tokens, s / CP)."""
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
    cp: int = 1
    act_bytes: int = 2          # A (the formulas count 2-byte activations; CP's extras are real bytes)
    scores: bool = True         # the attention keeps its a s^2 scores (unfused kernel); False: flash/fused
    schedule: str | None = None  # the pipeline schedule (its in-flight bound and chunk placement)


def _chunk_bytes(shape: GPTConfig, layers: list[int], run: _Run) -> tuple[float, float]:
    """(kept, transient) of one chunk holding global ``layers``, MoE layers' routed rows and the CP
    attention's saved tensors and working set included (2-byte units)."""
    kept, transient = chunk_activation_bytes(len(layers), run.s, run.b, shape.hidden_size, shape.num_attention_heads,
                                             run.tp, run.sp, run.recompute, run.method, run.num_layers,
                                             run.cp == 1 and run.scores)
    extra = moe_chunk_activation_bytes(shape, layers, run.s, run.b, run.tp, run.sp, run.etp, run.recompute,
                                       run.method, run.num_layers)
    cp = cp_chunk_activation_bytes(shape, len(layers), run.s, run.b, run.tp, run.cp, run.act_bytes, run.recompute,
                                   run.method, run.num_layers)
    units = 2 / run.act_bytes
    kept += len(layers) * mla_activation_delta(shape, run.s, run.b, run.tp, run.sp)  # MLA's head sizes, latents
    return kept + extra[0] + cp[0] * units, transient + extra[1] + cp[1] * units


def _rank_activation_bytes(shape: GPTConfig, r: int, run: _Run) -> float:
    """Pipeline rank ``r``'s activations (2-byte units): its in-flight chunk-activations (the most
    loaded of its chunks), the embedding's dropout masks on the first, the output terms on the last."""
    from megazero.pipeline import in_flight_bound
    s, b, h, tp = run.s, run.b, shape.hidden_size, run.tp
    layers = stage_layers(shape, run.pp, r, run.vp, run.schedule)
    per = len(layers) // run.vp
    chunks = [_chunk_bytes(shape, layers[c * per:(c + 1) * per], run) for c in range(run.vp)]
    kept, transient = max(c[0] for c in chunks), max(c[1] for c in chunks)
    k = in_flight_bound(run.pp, run.vp, run.m, r, run.schedule)
    act = k * kept + transient
    first, last = _ends(run.pp, r, run.schedule)
    if first:
        act += min(-(-k // run.vp), run.m) * s * b * h / (tp if run.sp else 1)
    if last:
        act += 4 * s * b * h / tp + 4 * s * b * shape.padded_vocab(tp) / tp
        if shape.mtp_num_layers:  # block recompute leaves the MTP layers stored (megazero.model.mtp)
            mtp_run = replace(run, recompute=None) if run.recompute == "full" and run.method == "block" else run
            act += mtp_activation_bytes(shape, _chunk_bytes(shape, mtp_layers(shape)[:1], mtp_run)[0], k, s, b, tp)
    return act


def _zero_comm(phi: float, n: int, zero: int, m: int, p: int, g: int) -> float:
    if n <= 1 or not phi:
        return 0.0
    gp, pb = g * phi, p * phi
    return {0: _ar(gp, n), 1: _rs(gp, n) + _rs(pb, n), 2: m * _rs(gp, n) + _rs(pb, n),
            3: m * (2 * _rs(pb, n) + _rs(gp, n))}[zero]


def _communication(x: Layout, shape: GPTConfig, run: _Run, A: int, param_bytes: int, grad_bytes: int) -> None:
    """Fill ``x``'s communication per step: dense states over DP x CP, experts' over EDP, TP (an MoE
    layer without a shared expert has only the attention's half), PP, the dispatcher, CP's attention."""
    s, b, h, tp, m = run.s, run.b, shape.hidden_size, run.tp, run.m
    x.comm_dp_bytes = _zero_comm(x.params - x.expert_params, x.dp * x.cp, x.zero, m, param_bytes, grad_bytes)
    x.comm_edp_bytes = _zero_comm(x.expert_params, x.edp, x.zero, m, param_bytes, grad_bytes)
    layers = stage_layers(shape, run.pp, x.stage, run.vp, run.schedule)
    moe_layers = sum(shape.moe.is_moe(n) for n in layers) if shape.moe is not None else 0
    if tp > 1:
        per_layer = (6 if run.recompute == "full" else 4) * _ar(s * b * h * A, tp)
        moe_share = 1.0 if moe_layers and shape.moe.shared_expert_intermediate_size else 0.5
        x.comm_tp_bytes = m * (len(layers) - moe_layers + moe_share * moe_layers) * per_layer
    if run.pp > 1:
        x.comm_pp_bytes = m * 2 * run.vp * s * b * h * A / (tp if run.sp else 1)
    if moe_layers:
        x.comm_ep_bytes = m * moe_layers * dispatch_bytes(shape, s * b / tp, x.ep, x.etp, A, run.recompute == "full")
    x.comm_cp_bytes = m * len(layers) * cp_attention_bytes(shape, s, b, tp, run.cp, A, run.recompute == "full")


def estimate(shape: GPTConfig, tp: int, pp: int, dp: int, zero: int, *, micro_batch_size: int, micro_batches: int,
             vp: int = 1, param_bytes: int = 2, grad_bytes: int = 2, sequence_parallel: bool = False,
             recompute: str | None = None, recompute_method: str | None = None,
             recompute_num_layers: int | None = None, gpu_memory_gb: float = 80.0, ep: int = 1,
             etp: int | None = None, cp: int = 1, attention_scores: bool = True, schedule: str | None = None) -> Layout:
    """Memory and communication of one layout, at its most loaded pipeline stage. ``attention_scores``
    False: a flash/fused attention kernel keeps no ``5 a s^2 b`` scores (the selective figure). MoE: ``ep``
    experts-parallel ranks, ``etp`` expert TP (None: TP); expert states over EDP = TP CP DP / (ETP EP).
    ``cp``: context-parallel ranks (``shape.cp_comm_type``), ``dp`` excluding them; ``ValueError``
    unless they can split the sequence (:func:`~megazero.planner.cp_memory.check_cp_layout`). ``schedule``: the
    pipeline schedule (``--pipeline-schedule``; its in-flight activations and, zbv/dualpipev, the V placement)."""
    check_cp_layout(shape, cp, tp, sequence_parallel)
    etp = tp if etp is None else etp
    edp = expert_data_parallel(tp, dp, ep, etp, cp)
    act_scale = 2 if param_bytes == 4 else 1  # the formulas count 2-byte activations
    run = _Run(shape.seq_length // cp, micro_batch_size, tp, pp, vp, micro_batches, sequence_parallel and tp > 1,
               recompute, recompute_method, recompute_num_layers, etp, cp, 2 * act_scale, attention_scores, schedule)
    best = None
    for r in range(pp):
        dense, expert = stage_param_split(shape, tp, pp, r, vp, ep, etp, schedule)
        states = (model_state_bytes(dense, zero, dp * cp, param_bytes, grad_bytes)
                  + model_state_bytes(expert, zero, edp, param_bytes, grad_bytes))
        act = _rank_activation_bytes(shape, r, run) * act_scale
        if best is None or states + act > best.total_bytes:
            best = Layout(tp, pp, dp, zero, vp, micro_batches, r, dense + expert, states, act, states + act,
                          ep=ep, etp=etp, edp=edp, expert_params=expert, cp=cp, schedule=schedule)
    _communication(best, shape, run, run.act_bytes, param_bytes, grad_bytes)
    best.fits = best.total_bytes <= gpu_memory_gb * GiB
    return best
