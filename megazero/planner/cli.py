"""The planner's command line: ``python -m megazero.planner`` with any ``pretrain_gpt.py`` flags
(see the package docstring for the formulas and ``docs/plan.md``)."""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import asdict

from megazero.config.cp_flags import CP_COMM_TYPES, NOT_AVAILABLE
from megazero.config.model import gpt_config

from . import GiB, Layout, active_params, plan, total_params

EXPERT_SIZES = ("expert_model_parallel_size", "expert_tensor_parallel_size")
CP_FLAGS = ("context_parallel_size", "cp_comm_type")
CP_KINDS = {"p2p": "p2p (ring)", "a2a": "a2a (Ulysses)"}


def build_parser():
    from megazero.arguments import build_parser as megatron_parser
    p = megatron_parser(prog="python -m megazero.planner")
    p.description = "Per-GPU memory and communication of every (TP, PP, DP, ZeRO) layout (see docs/plan.md)."
    g = p.add_argument_group("planner")
    g.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    g.add_argument("--gpu-memory-gb", type=float, default=80.0, help="device memory in GiB [80]")
    g.add_argument("--max-tensor-parallel-size", type=int, default=8, help="largest TP tried [8: one node]")
    g.add_argument("--fits-only", action="store_true", help="list only the layouts that fit")
    g.add_argument("--json", action="store_true", help="one JSON object per layout instead of the table")
    g.add_argument("--try-context-parallel", action="store_true",
                   help="try every context-parallel size dividing world / (TP PP) [CP: --context-parallel-size, 1]")
    p.set_defaults(tensor_model_parallel_size=None, pipeline_model_parallel_size=None, zero_stage=None,
                   expert_model_parallel_size=None, expert_tensor_parallel_size=None, context_parallel_size=None,
                   cp_comm_type=None)
    return p


def _literal(value):
    if isinstance(value, list):
        return [_literal(v) for v in value]
    try:
        return ast.literal_eval(value) if isinstance(value, str) else value
    except (ValueError, SyntaxError):
        return value


def with_moe_flags(args) -> argparse.Namespace:
    """``args`` with the MoE flags (``--num-experts``, ``--moe-*``, EP and ETP) and the CP ones
    (``--context-parallel-size``, ``--cp-comm-type``) under their plain names, typed: the parser may
    hold them as Megatron flags it does not train with (``megatron:<dest>`` strings,
    :mod:`megazero.config.megatron_flags`) -- the planner plans them."""
    values = dict(vars(args))
    for dest, value in vars(args).items():
        name = dest.partition("megatron:")[2]
        if name and (name == "num_experts" or name.startswith("moe_") or name in EXPERT_SIZES + CP_FLAGS) \
                and values.get(name) is None:
            values[name] = _literal(value)
    return argparse.Namespace(**values)


def context_parallel(args, parser) -> int | None:
    """The CP size to plan (None: try every one) with ``args.cp_comm_type`` made one string (Megatron
    takes one per layer; megazero runs one kind); refuses what CP cannot run."""
    kinds = list(dict.fromkeys(args.cp_comm_type if isinstance(args.cp_comm_type, list) else
                               [args.cp_comm_type or "p2p"]))
    for kind in kinds:
        if kind not in CP_COMM_TYPES:
            why = NOT_AVAILABLE.get(kind, "megazero has " + ", ".join(CP_COMM_TYPES))
            parser.error(f"--cp-comm-type {kind}: {why}")
    if len(kinds) != 1:
        parser.error(f"--cp-comm-type {' '.join(kinds)}: one type per layer is not available; give one for all layers")
    args.cp_comm_type = kinds[0]
    cp = args.context_parallel_size or 1
    if args.try_context_parallel and cp > 1:
        parser.error("--try-context-parallel tries every CP size: drop --context-parallel-size")
    if (args.try_context_parallel or cp > 1) and args.attention_dropout:
        parser.error("context parallelism needs --attention-dropout 0 (the ring attention draws no dropout)")
    return None if args.try_context_parallel else cp


def _fmt(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_table(layouts: list[Layout], gpu_memory_gb: float, moe: bool = False, cp: bool = False) -> str:
    """The table; ``moe`` adds the expert grid (EP, ETP, EDP), the experts' share of ``params/rank``
    and the EDP and EP (dispatcher) parts of the communication; ``cp`` the CP column and the CP
    attention's part (``dp`` is then the gradients' over DP x CP)."""
    parts = ["dp", "tp", "pp"] + (["edp", "ep"] if moe else []) + (["cp"] if cp else [])
    grid = f" {'EP':>3} {'ETP':>3} {'EDP':>4}" if moe else ""
    head = (f"{'TP':>3} {'PP':>3} {'VP':>3} " + (f"{'CP':>3} " if cp else "") + f"{'DP':>4} {'ZeRO':>4}{grid} "
            f"{'M':>4} {'stage':>5} {'params/rank':>13} " + (f"{'experts':>13} " if moe else "")
            + f"{'states':>8} {'activ.':>8} {'total':>8} {'comm/step':>9} "
            + " ".join(f"{('(' if i == 0 else '') + n + (')' if i == len(parts) - 1 else ''):>8}"
                       for i, n in enumerate(parts)) + f"  fits {gpu_memory_gb:g} GiB")
    rows = [head, "-" * len(head)]
    for x in layouts:
        grid = f" {x.ep:>3} {x.etp:>3} {x.edp:>4}" if moe else ""
        rows.append(f"{x.tp:>3} {x.pp:>3} {x.vp:>3} " + (f"{x.cp:>3} " if cp else "")
                    + f"{x.dp:>4} {x.zero:>4}{grid} {x.micro_batches:>4} {x.stage:>5} "
                    f"{x.params:>13,} " + (f"{x.expert_params:>13,} " if moe else "")
                    + f"{_fmt(x.model_state_bytes)} {_fmt(x.activation_bytes)} {_fmt(x.total_bytes)} "
                    f"{_fmt(x.comm_bytes):>9} " + " ".join(_fmt(getattr(x, f"comm_{n}_bytes")) for n in parts)
                    + f"  {'yes' if x.fits else '-'}")
    return "\n".join(rows)


def moe_line(shape) -> str:
    """What the planner read of an MoE model: experts, top-k, MoE layers, expert and active parameters."""
    moe = shape.moe
    return (f"MoE: {moe.num_experts} experts (FFN {moe.ffn_hidden_size}), top-{moe.router_topk}, "
            f"{moe.num_moe_layers} of {shape.num_layers} layers"
            + (f", shared expert {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size else "")
            + f"; {active_params(shape):,} parameters active per token; {moe.token_dispatcher} dispatcher"
            + (f", capacity factor {moe.capacity_factor:g}" if moe.capacity_factor is not None else ", dropless"))


def _layouts(args, shape, param_bytes: int, grad_bytes: int, cp: int | None) -> list[Layout]:
    return plan(shape, args.world_size, micro_batch_size=args.micro_batch_size,
                global_batch_size=args.global_batch_size, tp=args.tensor_model_parallel_size,
                pp=args.pipeline_model_parallel_size, zero=args.zero_stage, max_tp=args.max_tensor_parallel_size,
                layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage, param_bytes=param_bytes,
                grad_bytes=grad_bytes, sequence_parallel=args.sequence_parallel,
                recompute=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, gpu_memory_gb=args.gpu_memory_gb,
                ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size, cp=cp)


def main(argv=None) -> int:
    parser = build_parser()
    args = with_moe_flags(parser.parse_args(argv))
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                           "vocab_size") if getattr(args, f) is None]
    if missing:
        parser.error("needs " + ", ".join("--" + f.replace("_", "-") for f in missing))
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are mutually exclusive")
    cp = context_parallel(args, parser)
    try:
        shape = gpt_config(args)
    except ValueError as e:
        parser.error(str(e))
    param_bytes = 2 if (args.fp16 or args.bf16) else 4
    grad_bytes = 4 if (args.bf16 or param_bytes == 4 or args.accumulate_allreduce_grads_in_fp32) else 2
    layouts = _layouts(args, shape, param_bytes, grad_bytes, cp)
    if args.fits_only:
        layouts = [x for x in layouts if x.fits]
    if args.json:
        for x in layouts:
            print(json.dumps(dict(asdict(x), comm_bytes=x.comm_bytes)))
        return 0
    dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    print(f"model: {total_params(shape):,} parameters (vocab {shape.vocab_size} padded to "
          f"{shape.padded_vocab(1)} at TP 1); world {args.world_size}; {dtype} (params {param_bytes} B, grads "
          f"{grad_bytes} B, optimizer 12 B per parameter); seq {shape.seq_length}, micro-batch "
          f"{args.micro_batch_size}; recompute {args.recompute_granularity or 'none'}"
          f"{', sequence parallel' if args.sequence_parallel else ''}"
          + (f"; context parallel {CP_KINDS[shape.cp_comm_type]}" if cp != 1 else ""))
    if shape.moe is not None:
        print(moe_line(shape))
    if not layouts:
        print("no valid layout")
        return 1
    print(format_table(layouts, args.gpu_memory_gb, moe=shape.moe is not None, cp=cp != 1))
    print(f"{sum(x.fits for x in layouts)} of {len(layouts)} layouts fit {args.gpu_memory_gb:g} GiB; memory and "
          "communication in GiB per GPU (the most loaded pipeline stage); see docs/plan.md")
    return 0
