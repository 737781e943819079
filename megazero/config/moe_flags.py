"""Mixture of Experts and expert parallelism on the command line: Megatron-LM's ``--num-experts``
and ``--moe-*`` flags (core_v0.20.0: ``_add_moe_args`` and the ``moe_*`` fields of
``TransformerConfig``, same names, dests, types and defaults) and their checks.

The flags land in the namespace as Megatron names them; :class:`megazero.moe.config.MoEConfig`
(via ``GPTConfig.from_megatron``) turns them into the model's frozen config. Values that
Megatron accepts and megazero does not have (a ``flex`` dispatcher, ``sqrtsoftplus`` scores,
``sinkhorn`` balancing, ...) are not argparse choices: :func:`check_moe` names each with what to
use instead, in the one ``prog: error:`` line of :func:`megazero.config.checks.validate`, like
every other problem. ``--moe-grouped-gemm`` is honoured as megazero's one expert path: each
rank runs its experts' matmuls on the tokens routed to them, the numbers Megatron's grouped
GEMM gives.
"""

from __future__ import annotations

import argparse

from megazero.config.cp_flags import model_parallel_product
from megazero.model.config import default_ffn_hidden_size
from megazero.moe.config import DISPATCHERS, DROP_POLICIES, LOAD_BALANCING_TYPES, SCORE_FUNCTIONS, MoEConfig
from megazero.parallel.layout import layout

# Values of Megatron's choices that megazero refuses, with what each is and what to use instead.
NOT_AVAILABLE = {
    "moe_token_dispatcher_type": {
        "flex": "the flex dispatcher runs DeepEP/HybridEP/NCCL EP kernels, not available here; use alltoall "
                "(or allgather): the same routing, exchanged with torch.distributed all-to-all"},
    "moe_router_score_function": {
        "sqrtsoftplus": "sqrt(softplus) router scores are not available; use softmax or sigmoid"},
    "moe_router_load_balancing_type": {
        "global_aux_loss": "the aux loss over the global batch is not available; use aux_loss (per micro-batch) "
                           "or seq_aux_loss",
        "sinkhorn": "Sinkhorn routing (S-BASE) is not available; use aux_loss, or sigmoid scores with "
                    "--moe-router-enable-expert-bias for aux-loss-free balancing",
        "quantile_balancing": "quantile balancing is not available; use sigmoid scores with "
                              "--moe-router-enable-expert-bias (a per-expert bias, DeepSeek-V3's)"},
}
CHOICES = {"moe_token_dispatcher_type": DISPATCHERS, "moe_router_score_function": SCORE_FUNCTIONS,
           "moe_router_load_balancing_type": LOAD_BALANCING_TYPES, "moe_token_drop_policy": DROP_POLICIES,
           "moe_router_dtype": ("fp32", "fp64")}


def moe_freq(text: str):
    """``--moe-layer-freq``: an int when the text is one, else the text itself (a list expression
    such as ``"([1]*3+[0])*2"``; :func:`megazero.moe.config.layer_pattern` reads it, without
    ``eval``, once ``--num-layers`` is known)."""
    try:
        return int(text)
    except ValueError:
        return text


def _metavar(dest: str) -> str:
    return "{" + ",".join(CHOICES[dest]) + "}"


def add_moe_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's MoE flags (the expert-parallel sizes are with the other sizes, ``distributed``)."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (None: dense)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=moe_freq, default=1,
                   help="N: layers 0, N, 2N, ... are MoE; or a list expression of 0/1 per layer, e.g. '([1]*3+[0])*2'")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-score-function", default="softmax", metavar=_metavar("moe_router_score_function"))
    g.add_argument("--moe-router-pre-softmax", action="store_true", help="softmax over all experts before the top-k")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None, help="multiplies the routing weights")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="expert groups for group-limited routing")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="groups kept per token")
    g.add_argument("--moe-router-dtype", default=None, metavar=_metavar("moe_router_dtype"),
                   help="router logits and routing weights in this dtype (default the input's)")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   metavar=_metavar("moe_router_load_balancing_type"))
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="one coefficient per load-balancing type")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the sigmoid scores (DeepSeek-V3)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="the bias step per iteration")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared expert every token passes through (None: none)")
    g.add_argument("--moe-shared-expert-gate", action="store_true", help="sigmoid gate on the shared expert (Qwen-MoE)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens per expert capped at ceil(tokens x topk / experts x factor); default dropless")
    g.add_argument("--moe-token-drop-policy", default="probs", metavar=_metavar("moe_token_drop_policy"),
                   help="over capacity keep the highest-weight (probs) or the earliest (position) tokens")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="every expert computes exactly its capacity of rows")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", metavar=_metavar("moe_token_dispatcher_type"),
                   help="how tokens reach their experts' ranks (Megatron's default allgather)")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="per-layer MoE losses in TensorBoard")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="accepted: megazero's experts always run as one path, each rank's experts on their tokens")


def add_expert_parallel_flags(g) -> None:
    """``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size`` (Megatron's
    ``ModelParallelConfig`` fields), into the ``distributed`` group ``g``."""
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: ranks the experts are spread over, carved out of data parallelism")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ETP: ranks each expert's weights are split over (default --tensor-model-parallel-size)")


def derive_moe(args) -> None:
    """Megatron's ``validate_args`` for these flags: ``--num-experts 0`` is a dense model (None),
    ``--expert-tensor-parallel-size`` defaults to TP, a one-entry load-balancing list or
    coefficient list becomes its value."""
    if args.num_experts == 0:
        args.num_experts = None
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_expert_grid(err, args) -> None:
    """EP and ETP at least 1; EP only for an MoE model, dividing its experts; Megatron's expert
    grid (``initialize_model_parallel``): ``ETP x EP x PP`` divides the world, i.e. ``ETP x EP``
    divides a pipeline stage's ``TP x CP x DP`` ranks (:func:`megazero.parallel.topology.layout`)."""
    ep, etp, experts = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.num_experts
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    for dest in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            err(f"{_flag(dest)} must be >= 1, got {getattr(args, dest)}")
    if ep > 1 and not experts:
        err(f"--expert-model-parallel-size {ep} needs --num-experts: expert parallelism spreads the experts "
            "of an MoE model (drop it for a dense model)")
    elif experts and experts > 0 and ep >= 1 and experts % ep:
        err(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    etp = tp if etp is None else etp
    if min(tp, pp, ep, etp) < 1 or world % model_parallel_product(args):
        return  # sizes below 1 and TP x CP x PP not dividing the world are named by their own checks
    try:
        layout(world, tp=tp, pp=pp, cp=getattr(args, "context_parallel_size", 1), ep=ep, etp=etp)
    except ValueError as e:
        err(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} x "
            f"--pipeline-model-parallel-size {pp} = {etp * ep * pp} must divide the world size {world} "
            f"(Megatron's expert grid; {e})")


def check_choices(err, args) -> bool:
    """Each value one of megazero's choices: one Megatron has and megazero does not is named with
    what to use instead (only for an MoE model: a dense one ignores them, as in Megatron); any
    other value is named with the choices. Returns whether all were fine."""
    ok = True
    for dest, choices in CHOICES.items():
        value = getattr(args, dest)
        for v in value if isinstance(value, list) else [value]:
            if v in choices or (v is None and dest == "moe_router_dtype"):
                continue
            reason = NOT_AVAILABLE.get(dest, {}).get(v)
            if reason and not args.num_experts:
                continue
            ok = False
            err(f"{_flag(dest)} {v}: {reason}" if reason else
                f"{_flag(dest)} {v!r} is not a choice: {', '.join(choices)}")
    return ok


def check_moe_model(err, args) -> None:
    """An MoE model's flags: no biases; sizes positive; what :class:`MoEConfig` refuses (top-k
    above the experts, a capacity factor <= 0, ``--moe-layer-freq`` of the wrong length, ...);
    the experts' FFN divisible by ETP and the shared expert's by TP."""
    if not args.num_experts:
        return
    if args.add_bias_linear:
        err("--num-experts needs --disable-bias-linear: megazero's experts have no biases (Megatron's "
            "grouped-GEMM experts refuse them too)")
    for dest in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            err(f"{_flag(dest)} must be >= 1, got {getattr(args, dest)}")
            return
    if args.num_layers is None or args.num_layers < 1:
        return  # named by the required-value and size checks
    ffn = args.ffn_hidden_size or default_ffn_hidden_size(args.hidden_size or 0, args.swiglu)
    try:
        moe = MoEConfig.from_megatron(vars(args), args.num_layers, ffn)
    except ValueError as e:
        err(str(e))
        return
    tp = max(args.tensor_model_parallel_size, 1)
    etp = args.expert_tensor_parallel_size or tp
    if etp >= 1 and moe.ffn_hidden_size % etp:
        shown = args.moe_ffn_hidden_size or f"{moe.ffn_hidden_size} (from --ffn-hidden-size)"
        err(f"--moe-ffn-hidden-size {shown} is not divisible by --expert-tensor-parallel-size {etp}")
    shared = moe.shared_expert_intermediate_size
    if shared and shared % tp:
        err(f"--moe-shared-expert-intermediate-size {shared} is not divisible by --tensor-model-parallel-size {tp}")


def check_moe(err, args) -> None:
    """Every check of the MoE and expert-parallel flags (before any process group)."""
    check_expert_grid(err, args)
    if check_choices(err, args):
        check_moe_model(err, args)


def check_moe_training(err, args) -> None:
    """A training run (``pretrain_gpt.py``): MoE with TP > 1 needs --sequence-parallel, as
    Megatron-LM core_v0.20.0's ``MoELayer`` demands in training (it raises at the first forward;
    here before any work)."""
    tp = args.tensor_model_parallel_size
    if args.num_experts and tp > 1 and not args.sequence_parallel:
        err(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel in training "
            "(as Megatron-LM: MoE with tensor parallelism runs with sequence parallelism)")
