"""Every command-line flag, with Megatron-LM's names and meanings, validation and derived values.

``parse_args(argv)`` parses, merges an optional DeepSpeed JSON config (``--deepspeed-config``,
read as DeepSpeed reads it by :mod:`megazero.deepspeed_config`), validates and derives, all before any
process group exists. Invalid input exits with status 2 and one ``prog: error: A; B; ...`` line
that names the flags, paths and numbers of every problem found. Nothing here has side effects beyond reading the config file.

Derived values, computed only in :func:`derive` (called by ``parse_args``):

* ``world_size``                      -- from ``WORLD_SIZE`` / ``SLURM_NTASKS`` (default 1)
* ``data_parallel_size``              -- ``world / (TP * PP)``
* ``num_micro_batches``               -- ``global_batch / (micro_batch * DP)``
* ``virtual_pipeline_model_parallel_size`` -- ``num_layers / (PP * layers_per_virtual_stage)``
* ``lr_decay_iters``                  -- ``train_iters`` unless given
* ``params_dtype``                    -- ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``

The model's own derived sizes (FFN size, head size, query groups, the padded vocabulary) are
not written here: :class:`megazero.model.GPTConfig` derives them, once, when the run's configs
are built (``megazero.training.build``), after the tokenizer has given the vocabulary size.

``parse_args`` returns :class:`Arguments`, frozen once validated: assigning to it raises, so no
later step can change what the flags said (use :meth:`Arguments.replace` for a modified copy).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from megazero.args_checks import derive, report, validate
from megazero.path_checks import PATH_CHECKS
from megazero.run_checks import TOKENIZERS, early_problems
from megazero.deepspeed_config import apply_deepspeed_config
from megazero.megatron_flags import add_compat_flags, apply_megatron_flags



def _int_like(text: str) -> int:
    """Parse ``5e8`` / ``500000000`` / ``1_000`` as an int (DeepSpeed configs write floats)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    return int(value)


class Arguments(argparse.Namespace):
    """The parsed flags; read-only after :func:`parse_args` validated them."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"arguments are frozen after validation; cannot set {name!r} "
                                 "(build a config object, or use args.replace(...) for a copy)")
        super().__setattr__(name, value)

    def freeze(self) -> "Arguments":
        self.__dict__["_frozen"] = True
        return self

    def replace(self, **changes) -> "Arguments":
        """A frozen copy with ``changes`` applied (no re-validation)."""
        values = {k: v for k, v in vars(self).items() if k != "_frozen"}
        values.update(changes)
        return Arguments(**values).freeze()

    def as_dict(self) -> dict:
        """The flags' values by ``dest`` name."""
        return {k: v for k, v in vars(self).items() if k != "_frozen"}


def _model_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
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


def _training_flags(p: argparse.ArgumentParser) -> None:
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


def _evaluation_and_logging_flags(p: argparse.ArgumentParser) -> None:
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


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load and no checkpoint there, exit instead of starting from scratch")
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="torch_dist or torch: megazero's format (reshards on load, like torch_dist)")

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


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    """The parallel layout, the process groups and ZeRO (DeepSpeed's names via --deepspeed-config)."""
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)
    g.add_argument("--use-distributed-optimizer", action="store_true", help="= ZeRO stage 1 (at least)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="gradient reduction overlapped with backward (megazero's default, --zero-overlap-comm)")

    g = p.add_argument_group("ZeRO (DeepSpeed names in --deepspeed-config)")
    g.add_argument("--zero-stage", type=int, default=0)
    g.add_argument("--zero-reduce-bucket-size", type=_int_like, default=500_000_000)
    g.add_argument("--zero-overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--zero-prefetch-bucket-size", type=_int_like, default=50_000_000)
    g.add_argument("--zero-param-persistence-threshold", type=_int_like, default=100_000)
    g.add_argument("--zero-max-live-parameters", type=_int_like, default=1_000_000_000)
    g.add_argument("--zero-max-reuse-distance", type=_int_like, default=1_000_000_000)
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", default=None, metavar="FILE",
                   help="DeepSpeed JSON config, read as DeepSpeed reads it (docs/zero.md, 'DeepSpeed config keys')")
    g.add_argument("--deepspeed", action="store_true",
                   help="accepted for DeepSpeed launch scripts; no effect (as in DeepSpeed: a helper flag)")
    p.set_defaults(adam_w_mode=True, deepspeed_scheduler=None)  # set from the config's optimizer/scheduler


def _data_flags(p: argparse.ArgumentParser) -> None:
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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                description="megazero: 3D-parallel GPT pretraining (Megatron-LM flag names).")
    for add_flags in (_model_flags, _training_flags, _evaluation_and_logging_flags, _checkpoint_flags,
                      _parallel_flags, _data_flags):
        add_flags(p)
    add_compat_flags(p)  # Megatron-LM's other flags: no effect here (class 2) or an error (class 3)
    return p


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Dests of the flags that appear literally in ``argv`` (abbreviations are disabled)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    dests = set()
    for action in parser._actions:
        if any(opt in given for opt in action.option_strings):
            dests.add(action.dest)
    return dests


def world_size_from_env(env=os.environ) -> int:
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key):
            return int(env[key])
    return 1


def parse_args(argv: list[str] | None = None, world_size: int | None = None, prog: str | None = None,
               training: bool = False, checks=()):
    """Parse, merge ``--deepspeed-config``, validate and derive. Exits with status 2 and one line
    listing every problem found on bad input. ``training`` (``pretrain_gpt.py``): also require
    what a training run needs (sizes, the length of the run, ``--lr``, data) and check the paths
    it names (:mod:`megazero.path_checks`), as Megatron's validation does. ``checks``: further
    ``check(err, args)`` run on the valid, derived values (``pretrain_gpt.py``: free space for one
    checkpoint, which needs the model's size); their problems are listed the same way."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv, namespace=Arguments())
    args.world_size = world_size if world_size is not None else world_size_from_env()
    problems = early_problems(args)
    apply_megatron_flags(args, problems.append)
    if args.deepspeed_config:
        apply_deepspeed_config(parser, args, _explicit_dests(parser, argv))
    validate(parser, args, training=training, extra_checks=PATH_CHECKS if training else (), problems=problems)
    derive(args)
    late = []
    for check in checks:
        check(late.append, args)
    report(parser, late)
    return args.freeze()
