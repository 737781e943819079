"""A layout's estimated step time on a GPU preset, and the ranking the planner prints (docs/plan.md).

**Compute** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", counting as their section 5.1): per token ``6 N`` for the matrix multiplies of the
N parameters a token passes through (the active ones; the input embedding, a lookup, not counted
unless tied to the output layer; learned positions never) plus ``12 L s (a d)`` for the attention's scores and weighted sum
(forward and backward, full ``s x s``, not halved for causality). A step's tokens are
``M mbs DP s``; each GPU does ``1 / world`` of it at ``peak x MFU`` (MFU an assumption, printed).
Full recompute adds a forward of the recomputed layers (``x 4/3`` when every layer is), selective
recompute the attention's forward scores again (``4 L s (a d)`` per token).

**Pipeline bubble**: ``(PP - 1) / (VP M)`` of the compute time (1F1B, interleaved with VP chunks).

**Communication**: each part of :class:`~megazero.planner.memory.Layout`'s bytes (what one rank sends)
over the bandwidth of its group: NVLink when the group lies inside one node, the GPU's network link
otherwise. Groups follow Megatron's rank order tp-cp-dp-pp (experts etp-ep-edp): a group of n ranks
at stride k lies in a node when ``k n <= GPUs per node`` (TP stride 1, CP stride TP, DP x CP
stride TP, PP stride TP CP DP; EP stride ETP, EDP stride ETP EP). ZeRO-3's gathers (two per
micro-batch) are in the DP bytes. No overlap with compute is assumed: an upper bound on the
communication's share, the same rule for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.model.config import GPTConfig
from megazero.planner.memory import GiB, Layout, active_params, embedding_params

from .presets import GPU

PARTS = ("tp", "cp", "dp", "edp", "ep", "pp")


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: compute, pipeline bubble and each communication part; ``links`` names the
    link each part crosses (``nvlink``/``network``)."""
    compute: float
    bubble: float
    comm: dict
    links: dict
    mfu: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.comm.values())


def flops_per_token(shape: GPTConfig, recompute: str | None = None, recomputed_fraction: float = 1.0) -> float:
    """Model FLOPs per token, forward and backward: ``6 N + 12 L s (a d)`` (module docstring), plus the
    recomputation's forward (``2 N + 4 L s a d`` x the recomputed fraction of layers with full, the
    attention's ``4 L s a d`` with selective)."""
    positions = shape.max_position_embeddings * shape.hidden_size if shape.learned_positions else 0
    n = active_params(shape) - (positions if shape.tied_embeddings else embedding_params(shape))
    d = shape.kv_channels if not shape.multi_latent_attention else (  # MLA: q k^T over d_q, p v over d_v
        (shape.qk_head_dim + shape.qk_pos_emb_head_dim + shape.v_head_dim) / 2)
    attn = shape.num_layers * shape.seq_length * shape.num_attention_heads * d
    flops = 6 * n + 12 * attn
    if recompute == "full":
        flops += recomputed_fraction * (2 * n + 4 * attn)
    elif recompute == "selective":
        flops += 4 * attn
    return flops


def within_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """A group of ``size`` ranks ``stride`` apart lies inside one node of ``gpus_per_node`` GPUs."""
    return size <= 1 or stride * size <= gpus_per_node


def _links(x: Layout, gpus_per_node: int) -> dict:
    groups = {"tp": (1, x.tp), "cp": (x.tp, x.cp), "dp": (x.tp, x.cp * x.dp), "pp": (x.tp * x.cp * x.dp, x.pp),
              "ep": (x.etp, x.ep), "edp": (x.etp * x.ep, x.edp)}
    return {k: "nvlink" if within_node(s, n, gpus_per_node) else "network" for k, (s, n) in groups.items()}


def recomputed_fraction(shape: GPTConfig, x: Layout, method: str | None, num_layers: int | None) -> float:
    """The share of a stage's layers full recompute replays: all (``uniform``), ``n`` of L/PP (``block``)."""
    if method != "block":
        return 1.0
    per_stage = shape.num_layers // x.pp
    return min(num_layers or 1, per_stage) / per_stage


def step_time(shape: GPTConfig, x: Layout, gpu: GPU, micro_batch_size: int, mfu: float,
              recompute: str | None = None, method: str | None = None, num_layers: int | None = None) -> StepTime:
    """Estimated seconds per step of layout ``x`` (module docstring): compute at ``mfu`` of the peak,
    the bubble, each communication part at its link's bandwidth."""
    world = x.tp * x.pp * x.cp * x.dp
    tokens = x.micro_batches * micro_batch_size * x.dp * shape.seq_length
    frac = recomputed_fraction(shape, x, method, num_layers)
    compute = flops_per_token(shape, recompute, frac) * tokens / world / (gpu.peak_tflops * 1e12 * mfu)
    bubble = compute * (x.pp - 1) / (x.vp * x.micro_batches)
    links = _links(x, gpu.gpus_per_node)
    comm = {k: getattr(x, f"comm_{k}_bytes") / gpu.bandwidth(links[k] == "nvlink") for k in PARTS}
    return StepTime(compute, bubble, comm, links, mfu)


@dataclass(frozen=True)
class Ranked:
    layout: Layout
    time: StepTime


def rank(layouts: list[Layout], times: list[StepTime]) -> list[Ranked]:
    """Layouts that fit by estimated step time (then memory), then those that do not by memory."""
    rows = [Ranked(x, t) for x, t in zip(layouts, times)]
    fits = sorted((r for r in rows if r.layout.fits), key=lambda r: (r.time.total, r.layout.total_bytes))
    rest = sorted((r for r in rows if not r.layout.fits), key=lambda r: (r.layout.total_bytes, r.time.total))
    return fits + rest


def name(x: Layout) -> str:
    """``TP1 PP1 DP8 ZeRO-1`` (VP, CP, EP when used)."""
    return " ".join([f"TP{x.tp}", f"PP{x.pp}"] + ([f"VP{x.vp}"] if x.vp > 1 else [])
                    + ([f"CP{x.cp}"] if x.cp > 1 else []) + [f"DP{x.dp}"] + ([f"EP{x.ep}"] if x.ep > 1 else [])
                    + [f"ZeRO-{x.zero}"])


def _split(t: StepTime) -> str:
    parts = [f"compute {t.compute:.2f} s (MFU {t.mfu:g} assumed)"]
    if t.bubble:
        parts.append(f"bubble {t.bubble:.2f} s")
    parts += [f"{k.upper()} {v:.2f} s ({t.links[k]})" for k, v in t.comm.items() if v]
    return ", ".join(parts)


def recommendation(ranked: list[Ranked], memory_gib: float) -> list[str]:
    """The top layout and why: its memory and time, the split of the time, and the fastest layout that
    needs less memory with what it would cost (or the smallest layout when none fits)."""
    if not ranked or not ranked[0].layout.fits:
        smallest = min(ranked, key=lambda r: r.layout.total_bytes, default=None)
        if smallest is None:
            return ["no valid layout"]
        return [f"no layout fits {memory_gib:g} GiB: the smallest, {name(smallest.layout)}, needs "
                f"{smallest.layout.total_bytes / GiB:.1f} GiB; try --recompute-granularity full (selective helps "
                "only unfused attention), --sequence-parallel, more GPUs or a larger --gpu"]
    top = ranked[0]
    x, t = top.layout, top.time
    lines = [f"recommended: {name(x)}: fits in {x.total_bytes / GiB:.1f} GiB of {memory_gib:g}, "
             f"est. {t.total:.2f} s/step" + (" (over 90 % of the device: leave room for the CUDA context and "
                                             "fragmentation, docs/plan.md)" if x.total_bytes > 0.9 * memory_gib * GiB
                                             else ""), f"  time: {_split(t)}"]
    smaller = [r for r in ranked if r.layout.fits and r.layout.total_bytes < x.total_bytes - 0.5 * GiB]
    if smaller:
        alt = smaller[0]
        saved = (x.total_bytes - alt.layout.total_bytes) / GiB
        lines.append(f"  {name(alt.layout)} would save {saved:.1f} GiB but cost "
                     f"{100 * (alt.time.total / t.total - 1):.1f}% more time")
    return lines
