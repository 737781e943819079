"""The planner's command line: ``python -m megazero.planner`` with any ``pretrain_gpt.py`` flags
(see the package docstring for the formulas and ``docs/plan.md``)."""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import asdict

from megazero.config.cp_flags import CP_COMM_TYPES, NOT_AVAILABLE
from megazero.config.model import gpt_config

from . import Layout, plan, total_params
from .presets import GPUS, gpu_preset
from .table import format_table, moe_line
from .timing import rank, recommendation, step_time

EXPERT_SIZES = ("expert_model_parallel_size", "expert_tensor_parallel_size")
CP_FLAGS = ("context_parallel_size", "cp_comm_type")
CP_KINDS = {"p2p": "p2p (ring)", "a2a": "a2a (Ulysses)"}


PLANNER_HELP = """Every pretrain_gpt.py flag is read as training reads it (model shape, --bf16, --sequence-parallel,
--recompute-*, --use-flash-attn / --attention-backend, parallel sizes, --global-batch-size ...);
--help-all lists them. A parallel size given (--tensor-model-parallel-size, --pipeline-model-parallel-size,
--zero-stage, --context-parallel-size) is fixed, the others are tried. See docs/plan.md."""


def add_planner_flags(g) -> None:
    """The planner's own flags (``g``: a parser or an argument group)."""
    g.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    g.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                   help="GPU preset: memory, NVLink and network bandwidth, peak BF16 FLOPs [h100]")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory in GiB a layout must fit [the --gpu preset's: h100 80, h200 140]")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (NVLink domain) [8]")
    g.add_argument("--assumed-mfu", type=float, default=0.45,
                   help="model FLOPs utilization assumed for the compute time, in (0, 1] [0.45]")
    g.add_argument("--max-tensor-parallel-size", type=int, default=8, help="largest TP tried [8: one node]")
    g.add_argument("--fits-only", action="store_true", help="list only the layouts that fit")
    g.add_argument("--top", type=int, default=None, help="print only the first N rows of the table")
    g.add_argument("--json", action="store_true", help="one JSON object per layout instead of the table")
    g.add_argument("--try-context-parallel", action="store_true",
                   help="try every context-parallel size dividing world / (TP PP) [CP: --context-parallel-size, 1]")
    g.add_argument("--try-pipeline-schedules", action="store_true",
                   help="rank every PP > 1 layout under each pipeline schedule it can run (1f1b, zb-h1, zbv, "
                   "dualpipev; interleaved-1f1b, interleaved-zb with --num-layers-per-virtual-pipeline-stage): "
                   "bubble and activation memory per schedule [--pipeline-schedule, else 1f1b/interleaved-1f1b]")
    g.add_argument("--help-all", action="store_true", help="show the training flags too and exit")


def short_parser() -> argparse.ArgumentParser:
    """``--help``: the planner's flags only."""
    p = argparse.ArgumentParser(prog="python -m megazero.planner", add_help=False, epilog=PLANNER_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Ranks every (TP, PP, DP, ZeRO) layout that fits by estimated step time.")
    p.add_argument("-h", "--help", action="help", help="show this help and exit")
    add_planner_flags(p.add_argument_group("planner"))
    return p


def build_parser():
    from megazero.arguments import build_parser as megatron_parser
    p = megatron_parser(prog="python -m megazero.planner")
    p.description = "Per-GPU memory, communication and step time of every (TP, PP, DP, ZeRO) layout (docs/plan.md)."
    add_planner_flags(p.add_argument_group("planner"))
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


def _layouts(args, shape, param_bytes: int, grad_bytes: int, cp: int | None, gpu) -> list[Layout]:
    return plan(shape, args.world_size, micro_batch_size=args.micro_batch_size,
                global_batch_size=args.global_batch_size, tp=args.tensor_model_parallel_size,
                pp=args.pipeline_model_parallel_size, zero=args.zero_stage, max_tp=args.max_tensor_parallel_size,
                layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage, param_bytes=param_bytes,
                grad_bytes=grad_bytes, sequence_parallel=args.sequence_parallel,
                recompute=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, gpu_memory_gb=gpu.memory_gib,
                ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size, cp=cp,
                attention_scores=attention_keeps_scores(args), schedules=_schedules(args))


def _schedules(args) -> tuple | None:
    """The pipeline schedules to rank layouts under: all with --try-pipeline-schedules, the one of
    --pipeline-schedule, else None (1F1B, interleaved 1F1B by VP)."""
    from megazero.pipeline import SCHEDULES
    if args.try_pipeline_schedules:
        return tuple(SCHEDULES)
    return (args.pipeline_schedule,) if args.pipeline_schedule else None


def attention_keeps_scores(args) -> bool:
    """Whether the attention kernel keeps Korthikanti's ``5 a s^2 b`` scores: only the unfused one
    (``--attention-backend unfused`` or ``local``, Megatron's core attention, megazero's SDPA math
    kernel). ``flash`` (``--use-flash-attn``), ``fused`` and ``auto`` (Megatron: Transformer Engine's
    flash/fused choice; megazero: SDPA's on CUDA) keep the output and a log-sum-exp per row only."""
    backend = "flash" if args.use_flash_attn else args.attention_backend
    return backend in ("unfused", "local")


def _check(args, parser) -> None:
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                           "vocab_size") if getattr(args, f) is None]
    if missing:
        parser.error("needs " + ", ".join("--" + f.replace("_", "-") for f in missing))
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are mutually exclusive")
    if not 0 < args.assumed_mfu <= 1:
        parser.error(f"--assumed-mfu {args.assumed_mfu}: give a fraction in (0, 1], e.g. 0.45")
    for flag in ("world_size", "gpus_per_node", "top", "max_tensor_parallel_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a positive integer")
    from megazero.pipeline import SCHEDULES
    if args.pipeline_schedule is not None and args.pipeline_schedule not in SCHEDULES:
        parser.error(f"--pipeline-schedule {args.pipeline_schedule}: choose one of {', '.join(SCHEDULES)}")
    if args.gpu_memory_gb is not None and not 0 < args.gpu_memory_gb < float("inf"):
        parser.error(f"--gpu-memory-gb {args.gpu_memory_gb}: give a positive number of GiB")


def _ranked(args, parser):
    """(shape, gpu, CP, ranked layouts, param bytes, grad bytes) of checked flags."""
    _check(args, parser)
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"  # Megatron's alias
    cp = context_parallel(args, parser)
    try:
        shape = gpt_config(args)
    except ValueError as e:
        parser.error(str(e))
    gpu = gpu_preset(args.gpu, args.gpu_memory_gb, args.gpus_per_node)
    param_bytes = 2 if (args.fp16 or args.bf16) else 4
    grad_bytes = 4 if (args.bf16 or param_bytes == 4 or args.accumulate_allreduce_grads_in_fp32) else 2
    layouts = _layouts(args, shape, param_bytes, grad_bytes, cp, gpu)
    if args.use_distributed_optimizer:  # Megatron's distributed optimizer: ZeRO stage 1 at least
        layouts = [x for x in layouts if x.zero >= 1 or x.dp * x.cp == 1]
    times = [step_time(shape, x, gpu, args.micro_batch_size, args.assumed_mfu, args.recompute_granularity,
                       args.recompute_method, args.recompute_num_layers) for x in layouts]
    return shape, gpu, cp, rank(layouts, times), param_bytes, grad_bytes


def _header(args, shape, gpu, cp, param_bytes: int, grad_bytes: int) -> str:
    dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    attention = "unfused (keeps a*s^2 scores)" if attention_keeps_scores(args) else "flash/fused"
    return (f"model: {total_params(shape):,} parameters (vocab {shape.vocab_size} padded to "
            f"{shape.padded_vocab(1)} at TP 1); world {args.world_size}; {dtype} (params {param_bytes} B, grads "
            f"{grad_bytes} B, optimizer 12 B per parameter); seq {shape.seq_length}, micro-batch "
            f"{args.micro_batch_size}; attention {attention}; recompute {args.recompute_granularity or 'none'}"
            f"{', sequence parallel' if args.sequence_parallel else ''}"
            + (f"; context parallel {CP_KINDS[shape.cp_comm_type]}" if cp != 1 else "")
            + f"\ngpu: {args.world_size} x {gpu.name}, {gpu.memory_gib:g} GiB, {gpu.gpus_per_node} per node; NVLink "
            f"{gpu.nvlink_gbps:g} GB/s, network {gpu.internode_gbps:g} GB/s per GPU and direction; peak "
            f"{gpu.peak_tflops:g} TFLOP/s x assumed MFU {args.assumed_mfu:g}")


def _selective_note(args, shape, gpu, top) -> list[str]:
    """Selective recompute drops the a s^2 scores; under flash/fused attention there are none to drop."""
    if args.recompute_granularity != "selective" or attention_keeps_scores(args) or not top.layout.fits:
        return []
    plain = step_time(shape, top.layout, gpu, args.micro_batch_size, args.assumed_mfu)
    return [f"  selective recompute saves no memory with flash/fused attention (no a*s^2 scores to drop) and "
            f"costs {100 * (top.time.total / plain.total - 1):.1f}% more time: drop --recompute-granularity"]


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help-all" in argv:
        build_parser().print_help()
        return 0
    if "-h" in argv or "--help" in argv:
        short_parser().print_help()
        return 0
    parser = build_parser()
    args = with_moe_flags(parser.parse_args(argv))
    shape, gpu, cp, ranked, param_bytes, grad_bytes = _ranked(args, parser)
    shown = [r for r in ranked if r.layout.fits] if args.fits_only else ranked
    if args.json:
        for r in shown:
            print(json.dumps(dict(asdict(r.layout), comm_bytes=r.layout.comm_bytes, step_s=r.time.total,
                                  compute_s=r.time.compute, bubble_s=r.time.bubble,
                                  comm_s={k: v for k, v in r.time.comm.items() if v}, links=r.time.links)))
        return 0
    print(_header(args, shape, gpu, cp, param_bytes, grad_bytes))
    if shape.moe is not None:
        print(moe_line(shape))
    if not ranked:
        print("no valid layout")
        return 1
    print("\n".join(recommendation(ranked, gpu.memory_gib) + _selective_note(args, shape, gpu, ranked[0])))
    if not shown:
        return 1
    print(format_table(shown[:args.top], gpu.memory_gib, moe=shape.moe is not None, cp=cp != 1,
                       schedules=_schedules(args) is not None))
    print(f"{sum(r.layout.fits for r in ranked)} of {len(ranked)} layouts fit {gpu.memory_gib:g} GiB, ranked by "
          "estimated step time (the rest by memory); memory and communication in GiB per GPU (the most loaded "
          "pipeline stage); see docs/plan.md")
    return 0
