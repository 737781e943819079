"""Every command-line flag megazero registers, by Megatron-LM's argument groups and names.

:func:`build_parser` is the parser of ``pretrain_gpt.py`` (and of the planner and the tools that
take training flags): the groups below with Megatron's names, defaults and meanings, then every
other flag of Megatron-LM's table (:mod:`.megatron_flags`: honoured elsewhere, accepted with no
effect, or refused). Validation and derivation are :mod:`.checks`'; the typed configs that the
run reads are built from the result by :mod:`.run_config`.
"""

from __future__ import annotations

import argparse
import math

from megazero.config.megatron_flags import add_compat_flags
from megazero.config.cp_flags import add_cp_flags
from megazero.config.mla_flags import add_mla_flags
from megazero.config.moe_flags import add_expert_parallel_flags, add_moe_flags
from megazero.config.mtp_flags import add_mtp_flags
from megazero.config.pipeline_flags import add_pipeline_schedule_flag
from megazero.config.muon_flags import add_muon_flags
from megazero.config.reliability_flags import add_reliability_flags
from megazero.config.run_checks import TOKENIZERS
from megazero.config.rank import current_rank


def int_like(text: str) -> int:
    """Parse ``5e8`` / ``500000000`` / ``1_000`` as an int (DeepSpeed configs write floats)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    return int(value)


def int_pair(text: str) -> tuple[int, int]:
    """``"4095,0"`` or ``"(4095,0)"`` -> ``(4095, 0)`` (Megatron-LM's ``tuple_type`` for ``--window-size``)."""
    try:
        left, right = (int(x) for x in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers left,right (e.g. 4095,0), got {text!r}")
    return left, right


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The network's shape, regularization and initialization (Megatron's names)."""
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4*hidden (SwiGLU: 8/3*hidden, multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA key/value heads; default = heads")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="no learned position embedding (with --position-embedding-type rope: nothing to drop)")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
                   help="SDPA backend on CUDA: flash, fused = memory-efficient, unfused/local = math, auto = SDPA's choice")
    g.add_argument("--use-flash-attn", action="store_true", help="= --attention-backend flash")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: stored w (initialized to 0), applied as 1 + w")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GELU's tanh approximation (GPT-2's), as Megatron-LM's flag; default exact GELU")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the QKV projection only (Qwen2); implied by biases on every linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a --normalization norm of each head's queries and keys before RoPE (Qwen3)")
    g.add_argument("--window-size", type=int_pair, default=None,
                   help="sliding-window attention (left,right), Megatron's tuple: W-1,0 = Mistral's window W")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

    g = p.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global L2 norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Batches, iterations, learning rate, evaluation and logging."""
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None, help="sample-based training (iterations derived)")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="'T:B ...'",
                   help="global batch size by consumed tokens; honoured while constant over the run")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="ignored, as in Megatron-LM core_v0.19.0 (deprecated there)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit after the iteration at which the run has lasted this long")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="per-token mean over the global batch (equal to megazero's; not with --eod-mask-loss)")
    g.add_argument("--exit-interval", type=int, default=None, help="exit after the iteration divisible by this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGUSR1, save a checkpoint and exit 0 at the end of the iteration (as Megatron)")
    g.add_argument("--exit-signal", default="SIGTERM", help="also trapped by --exit-signal-handler (a signal name)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    g.add_argument("--pipeline-trace", default=None, metavar="FILE",
                   help="write a Chrome-trace JSON of the pipeline schedule of one step")

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None, help="peak LR of the embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help="their floor (default --min-lr)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warm-up = fraction of the decay length")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="LR at the start of warm-up")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="take the schedule's settings from the flags, not the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="take the schedule's settings from the checkpoint")


def add_evaluation_and_logging_flags(p: argparse.ArgumentParser) -> None:
    """Evaluation cadence and logging / TensorBoard (Megatron's names)."""
    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true", help="throughput per GPU in the log line")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   dest="log_loss_scale_to_tensorboard", action="store_false")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--debug", action="store_true",
                   help="print the full traceback of a failure (also MEGAZERO_DEBUG=1); default one line")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Checkpointing and mixed precision."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="allow --save to be a folder holding another run's checkpoints (megazero)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints from a shared-memory snapshot by a long-lived writer process "
                        "per rank while training goes on (Megatron's flag; docs/checkpoints.md)")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only and reset iteration to 0")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model flags from the --load checkpoint's saved arguments (Megatron-LM's list)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load and no checkpoint there, exit instead of starting from scratch")
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="torch_dist or torch: megazero's format (reshards on load, like torch_dist); "
                        "torch_dcp: a PyTorch DCP folder (docs/checkpoints.md, Formats)")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="constant loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (always on with --bf16)")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """The parallel layout, the process groups and ZeRO (DeepSpeed's names via --deepspeed-config)."""
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add_pipeline_schedule_flag(g)  # --pipeline-schedule (megazero's own)
    g.add_argument("--sequence-parallel", action="store_true")
    add_cp_flags(g)  # --context-parallel-size, --cp-comm-type
    add_expert_parallel_flags(g)  # --expert-model-parallel-size, --expert-tensor-parallel-size
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)
    g.add_argument("--use-distributed-optimizer", action="store_true", help="= ZeRO stage 1 (at least)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="gradient reduction overlapped with backward (megazero's default, --zero-overlap-comm)")

    g = p.add_argument_group("ZeRO (DeepSpeed names in --deepspeed-config)")
    g.add_argument("--zero-stage", type=int, default=0)
    g.add_argument("--zero-reduce-bucket-size", type=int_like, default=500_000_000)
    g.add_argument("--zero-overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--zero-prefetch-bucket-size", type=int_like, default=50_000_000)
    g.add_argument("--zero-param-persistence-threshold", type=int_like, default=100_000)
    g.add_argument("--zero-max-live-parameters", type=int_like, default=1_000_000_000)
    g.add_argument("--zero-max-reuse-distance", type=int_like, default=1_000_000_000)
    g.add_argument("--zero-host-memory-policy", choices=["speed", "tight"], default="speed",
                   help="CPU ranks (glibc's malloc): 'speed' maps only stage 3's unit-sized buffers (freed smaller "
                   "blocks stay in the heap; glibc's own policy at stages 0-2); 'tight' maps every block of >= 1 MiB "
                   "at every stage, so freed ones leave the resident set at once, for page faults on every "
                   "micro-batch (docs/zero.md, 'Host memory on the CPU')")
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", default=None, metavar="FILE",
                   help="DeepSpeed JSON config, read as DeepSpeed reads it (docs/zero.md, 'DeepSpeed config keys')")
    g.add_argument("--deepspeed", action="store_true",
                   help="accepted for DeepSpeed launch scripts; no effect (as in DeepSpeed: a helper flag)")
    p.set_defaults(adam_w_mode=True, deepspeed_scheduler=None)  # set from the config's optimizer/scheduler


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """Datasets and tokenizers."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--mock-data", action="store_true", help="random tokens instead of --data-path")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--data-args-path", default=None, help="a file holding the --data-path list")
    for split in ("train", "valid", "test"):  # Megatron's blend_per_split: instead of --data-path/--split
        g.add_argument(f"--{split}-data-path", nargs="*", default=None, help=f"the {split} split's prefixes")
    for flag in ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"):  # training/data.py
        g.add_argument(flag, action="store_true", help="as Megatron's get_ltor_masks_and_position_ids")
    g.add_argument("--tokenizer-type", default=None, help="one of " + ", ".join(TOKENIZERS))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)


class OneRankParser(argparse.ArgumentParser):
    """An argument parser whose usage, errors and help are printed by global rank 0 only (the
    launcher's ``RANK`` / ``SLURM_PROCID``, read before any process group): under ``torchrun
    --nproc-per-node 4`` a bad flag is one message, not four; every rank still exits with the
    same status."""

    def print_usage(self, file=None):
        if current_rank() == 0:
            super().print_usage(file)

    def print_help(self, file=None):
        if current_rank() == 0:
            super().print_help(file)

    def exit(self, status=0, message=None):
        super().exit(status, message if current_rank() == 0 else None)


def build_parser(prog: str | None = None, every_rank: bool = False) -> argparse.ArgumentParser:
    """The parser; its messages by rank 0 only (:class:`OneRankParser`) unless ``every_rank``
    (a caller that captures the message itself, e.g. ``megazero.initialize``)."""
    p = (argparse.ArgumentParser if every_rank else OneRankParser)(prog=prog, allow_abbrev=False,
                                description="megazero: 3D-parallel GPT pretraining (Megatron-LM flag names).")
    for add_flags in (add_model_flags, add_mla_flags, add_moe_flags, add_mtp_flags, add_muon_flags, add_training_flags,
                      add_evaluation_and_logging_flags, add_checkpoint_flags, add_parallel_flags, add_data_flags,
                      add_reliability_flags):
        add_flags(p)
    add_compat_flags(p)  # Megatron-LM's other flags: no effect here (class 2) or an error (class 3)
    return p
