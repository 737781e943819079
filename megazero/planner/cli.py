"""The planner's command line: ``python -m megazero.planner`` with any ``pretrain_gpt.py`` flags
(see the package docstring for the formulas and ``docs/plan.md``)."""

from __future__ import annotations

import json
from dataclasses import asdict

from megazero.config.model import gpt_config

from . import GiB, Layout, plan, total_params


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
    p.set_defaults(tensor_model_parallel_size=None, pipeline_model_parallel_size=None, zero_stage=None)
    return p


def _fmt(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_table(layouts: list[Layout], gpu_memory_gb: float) -> str:
    head = (f"{'TP':>3} {'PP':>3} {'VP':>3} {'DP':>4} {'ZeRO':>4} {'M':>4} {'stage':>5} {'params/rank':>13} "
            f"{'states':>8} {'activ.':>8} {'total':>8} {'comm/step':>9} {'(dp':>8} {'tp':>8} {'pp)':>8}  fits "
            f"{gpu_memory_gb:g} GiB")
    rows = [head, "-" * len(head)]
    for x in layouts:
        rows.append(f"{x.tp:>3} {x.pp:>3} {x.vp:>3} {x.dp:>4} {x.zero:>4} {x.micro_batches:>4} {x.stage:>5} "
                    f"{x.params:>13,} {_fmt(x.model_state_bytes)} {_fmt(x.activation_bytes)} {_fmt(x.total_bytes)} "
                    f"{_fmt(x.comm_bytes):>9} {_fmt(x.comm_dp_bytes)} {_fmt(x.comm_tp_bytes)} "
                    f"{_fmt(x.comm_pp_bytes)}  {'yes' if x.fits else '-'}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                           "vocab_size") if getattr(args, f) is None]
    if missing:
        parser.error("needs " + ", ".join("--" + f.replace("_", "-") for f in missing))
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are mutually exclusive")
    try:
        shape = gpt_config(args)
    except ValueError as e:
        parser.error(str(e))
    param_bytes = 2 if (args.fp16 or args.bf16) else 4
    grad_bytes = 4 if (args.bf16 or param_bytes == 4 or args.accumulate_allreduce_grads_in_fp32) else 2
    layouts = plan(shape, args.world_size, micro_batch_size=args.micro_batch_size,
                   global_batch_size=args.global_batch_size, tp=args.tensor_model_parallel_size,
                   pp=args.pipeline_model_parallel_size, zero=args.zero_stage,
                   max_tp=args.max_tensor_parallel_size,
                   layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage, param_bytes=param_bytes,
                   grad_bytes=grad_bytes, sequence_parallel=args.sequence_parallel,
                   recompute=args.recompute_granularity, recompute_method=args.recompute_method,
                   recompute_num_layers=args.recompute_num_layers, gpu_memory_gb=args.gpu_memory_gb)
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
          f"{', sequence parallel' if args.sequence_parallel else ''}")
    if not layouts:
        print("no valid layout")
        return 1
    print(format_table(layouts, args.gpu_memory_gb))
    print(f"{sum(x.fits for x in layouts)} of {len(layouts)} layouts fit {args.gpu_memory_gb:g} GiB; memory and "
          "communication in GiB per GPU (the most loaded pipeline stage); see docs/plan.md")
    return 0

