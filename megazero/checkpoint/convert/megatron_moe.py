"""Megatron-core MoE checkpoints (legacy ``--ckpt-format torch``) as megazero names and pieces.

Facts from NVIDIA/Megatron-LM (core 0.20.0, commit d98e8a64; the legacy ``GroupedMLP`` from its
last version, ``2caa681a1d^``):

* Files (``megatron/training/checkpointing.py``, ``get_checkpoint_name``): ``mp_rank_TT``, then
  ``_PPP`` when PP > 1, then ``_EEE`` (the expert-parallel rank) when EP > 1; so one 3-digit
  suffix is PP's or EP's, told apart by the saved ``args``. ``save_checkpoint`` writes from every
  rank with DP rank 0 *or* expert-DP rank 0, one file per (TP rank, PP rank, EP rank) pair that
  occurs; the file holds the dense weights of its TP rank and the local experts of its EP rank,
  each split over expert TP (``expert_tensor_parallel_size``, default TP) -- its piece is that
  of the writing rank's expert-TP rank, ``TT mod ETP`` when ETP divides TP.
* Keys under ``decoder.layers.N.mlp.`` (``moe_layer.py``, ``router.py``, ``experts.py``,
  ``shared_experts.py``): ``router.weight`` ``[E, h]`` (replicated), ``router.expert_bias`` ``[E]``
  (fp32 buffer, ``--moe-router-enable-expert-bias``); routed experts, local expert ``k`` of EP rank
  ``r`` being global expert ``r E/EP + k``:

  - ``SequentialMLP``: ``experts.local_experts.k.linear_fc1.weight`` ``[2f/ETP, h]`` (SwiGLU: the
    piece's ``[gate_t; up_t]``, as a dense fc1) and ``...linear_fc2.weight`` ``[h, f/ETP]``;
  - ``TEGroupedMLP``: ``experts.linear_fc1.weight{k}`` / ``experts.linear_fc2.weight{k}``, the same
    shapes; with ``--moe-single-grouped-weight`` one ``experts.linear_fc1.weight`` stacking them;
  - legacy ``GroupedMLP``: ``experts.weight1`` ``[h, E_local 2f/ETP]`` whose memory viewed as
    ``[E_local, h, 2f/ETP]`` gives expert ``k``'s fc1 transposed, and ``experts.weight2``
    ``[E_local f/ETP, h]`` viewed as ``[E_local, f/ETP, h]`` its fc2 transposed;
  - shared expert: ``shared_experts.linear_fc1.weight`` / ``linear_fc2.weight`` (a dense MLP over
    TP) and ``shared_experts.gate_weight`` ``[1, h]``.

  megazero: ``layers.N.mlp.router.weight``, ``layers.N.mlp.router.expert_bias``,
  ``layers.N.mlp.experts.e.fc1.weight`` / ``fc2.weight`` (full: ``[gate; up]``),
  ``layers.N.mlp.shared_expert.fc1/fc2.weight``, ``layers.N.mlp.shared_expert_gate.weight``.
"""
from __future__ import annotations

import argparse
import re

import torch

from megazero.checkpoint.schema import CheckpointError
from megazero.moe.config import MOE_ARG_KEYS

MOE_KEY = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(router|experts|shared_experts)\.(.+)$")
SEQUENTIAL = re.compile(r"^local_experts\.(\d+)\.linear_(fc[12])\.weight$")
GROUPED = re.compile(r"^linear_(fc[12])\.weight(\d*)$")
# Megatron options that change the weights' layout or the model in ways megazero has not got
UNSUPPORTED = ("moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size", "moe_latent_size",
               "moe_apply_probs_on_input")


def moe_args(a: dict) -> dict:
    """The MoE part of a Megatron run's ``args`` under megazero's config names (Megatron's),
    ``{}`` for a dense model; raises naming the options megazero lacks."""
    if not a.get("num_experts"):
        return {}
    bad = [k for k in UNSUPPORTED if a.get(k)]
    if a.get("add_bias_linear", True):
        bad.append("add_bias_linear with MoE (megazero's experts and router have no biases)")
    if bad:
        raise CheckpointError(f"unsupported Megatron-LM MoE options: {', '.join(bad)}")
    out = {k: a.get(k) for k in MOE_ARG_KEYS if a.get(k) is not None}
    if out.get("moe_token_dispatcher_type") == "flex":  # a run choice, not the weights': megazero's default
        del out["moe_token_dispatcher_type"]
    if (out.get("moe_expert_capacity_factor") or 0) < 0:  # Megatron reads a negative factor as dropless
        del out["moe_expert_capacity_factor"]
    return out


def rank_files(raw: dict, directory: str, read_args) -> dict:
    """``{(tp, pp, ep): file}`` of the ``mp_rank_TT[_AAA][_BBB]`` folders ``{(TT, AAA, BBB): file}``
    (absent parts None): two suffixes are PP, EP; one is PP's when the saved run had PP > 1
    (``read_args(file)``, its ``args`` Namespace), else EP's. Every (TP, PP) and (PP, EP) pair
    must have a file (not every (TP, EP) pair has one when expert TP differs from TP)."""
    pp_run = None
    ranks = {}
    for (tp, a, b), path in raw.items():
        if a is not None and b is None:
            if pp_run is None:
                saved = vars(read_args(path) or argparse.Namespace())
                pp_run = int(saved.get("pipeline_model_parallel_size") or 1) > 1
            a, b = (a, 0) if pp_run else (0, a)
        ranks[(tp, a or 0, b or 0)] = path
    tp, pp, ep = (max(k[i] for k in ranks) + 1 for i in range(3))
    missing = [(t, p) for t in range(tp) for p in range(pp) if not any(k[:2] == (t, p) for k in ranks)]
    missing += [(p, e) for p in range(pp) for e in range(ep) if not any(k[1:] == (p, e) for k in ranks)]
    if missing:
        raise CheckpointError(f"{directory}: missing rank files for (tp, pp) / (pp, ep) {missing}")
    return ranks


def expert_tp(saved: dict, tp: int) -> int:
    """The saved run's expert-TP size (Megatron's default: TP); refused unless it divides TP
    (each file's expert piece is then that of expert-TP rank ``tp_rank mod ETP``)."""
    etp = int(saved.get("expert_tensor_parallel_size") or tp)
    if tp % etp:
        raise CheckpointError(f"expert_tensor_parallel_size {etp} does not divide TP {tp}: the files do not say "
                              "which expert piece each holds")
    return etp


def _expert_pieces(rest: str, tensor: torch.Tensor, per: int, hidden: int):
    """``[(local expert, "fc1"|"fc2", expert-TP piece as a linear weight)]`` of a key under
    ``mlp.experts.``; None for a key of no known layout."""
    m = SEQUENTIAL.match(rest)
    if m:
        return [(int(m.group(1)), m.group(2), tensor)]
    m = GROUPED.match(rest)
    if m and m.group(2):
        return [(int(m.group(2)), m.group(1), tensor)]
    if m:  # one grouped tensor of every local expert
        parts = tensor.unbind(0) if tensor.dim() == 3 else tensor.chunk(per, 0)
        return [(k, m.group(1), t) for k, t in enumerate(parts)]
    if rest == "weight1":
        return [(k, "fc1", w.t()) for k, w in enumerate(tensor.reshape(per, hidden, -1))]
    if rest == "weight2":
        return [(k, "fc2", w.t()) for k, w in enumerate(tensor.reshape(per, -1, hidden))]
    return None


def moe_tensors(key: str, tensor: torch.Tensor, config, ep: int, ep_rank: int):
    """``[(megazero name with the *local* layer and the global expert, local layer, tensor)]`` of
    a flattened Megatron key; ``[]`` for an entry holding no weight (``_extra_state``); None when
    ``key`` is not under an MoE layer's router, experts or shared experts."""
    m = MOE_KEY.match(key)
    if m is None:
        return None
    local, part, rest = int(m.group(1)), m.group(2), m.group(3)
    if rest.endswith("_extra_state"):
        return []
    prefix = f"layers.{local}.mlp."
    if config.moe is None:
        raise CheckpointError(f"{key}: an MoE weight in a checkpoint whose args have no num_experts")
    found = None
    if part == "router" and rest in ("weight", "expert_bias"):
        found = [(f"{prefix}router.{rest}", tensor)]
    elif part == "shared_experts" and rest == "gate_weight":
        found = [(f"{prefix}shared_expert_gate.weight", tensor)]
    elif part == "shared_experts" and rest in ("linear_fc1.weight", "linear_fc2.weight"):
        found = [(f"{prefix}shared_expert.{rest[7:10]}.weight", tensor)]
    elif part == "experts":
        per = config.moe.num_experts // ep
        pieces = _expert_pieces(rest, tensor, per, config.hidden_size)
        if pieces is not None:
            found = [(f"{prefix}experts.{ep_rank * per + k}.{fc}.weight", t.contiguous()) for k, fc, t in pieces]
    if found is None:
        raise CheckpointError(f"unknown Megatron-LM parameter {key!r}")
    return [(name, local, t) for name, t in found]


def is_expert_name(name: str) -> bool:
    """Whether a megazero name is a routed expert's (split over expert TP)."""
    return ".mlp.experts." in name


def mlp_suffix(suffix: str) -> str:
    """A layer suffix with an expert's or the shared expert's MLP seen as the dense MLP's
    (``mlp.experts.5.fc1.weight`` -> ``mlp.fc1.weight``): the same TP split rules."""
    return re.sub(r"^mlp\.(experts\.\d+|shared_expert)\.", "mlp.", suffix)


def moe_flags(moe) -> list[str]:
    """Megatron's MoE flags for a :class:`~megazero.moe.config.MoEConfig` (what an imported
    checkpoint trains with): expert count and size, top-k and layer pattern (``1`` when every
    layer is MoE, else the quoted list), then every other setting that differs from the default."""
    from megazero.moe.config import MoEConfig
    default = MoEConfig(num_experts=moe.num_experts, ffn_hidden_size=moe.ffn_hidden_size,
                        layer_pattern=moe.layer_pattern).to_args()
    freq = "1" if all(moe.layer_pattern) else "'[" + ",".join(str(v) for v in moe.layer_pattern) + "]'"
    out = [f"--num-experts {moe.num_experts}", f"--moe-ffn-hidden-size {moe.ffn_hidden_size}",
           f"--moe-router-topk {moe.router_topk}", f"--moe-layer-freq {freq}"]
    for key, value in moe.to_args().items():
        if key in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq") or \
                value == default[key] or value in (None, False):
            continue
        text = " ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        out.append("--" + key.replace("_", "-") + ("" if value is True else f" {text}"))
    return out
