"""Every command-line flag, with Megatron-LM's names and meanings, validation and derived values.

``parse_args(argv)`` parses, merges an optional DeepSpeed JSON config (``--deepspeed-config``,
read as DeepSpeed reads it by :mod:`megazero.deepspeed_config`), validates and derives, all before any
process group exists. Invalid input exits with status 2 and one ``prog: error: ...`` line that
names the flags and the numbers. Nothing here has side effects beyond reading the config file.

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
import warnings

import torch

from megazero.deepspeed_config import apply_deepspeed_config

TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
              "HuggingFaceTokenizer", "NullTokenizer")  # = megazero.data.tokenizers.TOKENIZER_TYPES



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
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
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
    g.add_argument("--exit-interval", type=int, default=None, help="exit after the iteration divisible by this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGUSR1, save a checkpoint and exit 0 at the end of the iteration (as Megatron)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--pipeline-trace", default=None, metavar="FILE",
                   help="write a Chrome-trace JSON of the pipeline schedule of one step")

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")

    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Checkpointing and mixed precision."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints from host copies in a background thread (Megatron's flag)")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only and reset iteration to 0")

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
    g.add_argument("--tokenizer-type", default=None, help="one of " + ", ".join(TOKENIZERS))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                description="megazero: 3D-parallel GPT pretraining (Megatron-LM flag names).")
    for add_flags in (_model_flags, _training_flags, _checkpoint_flags, _parallel_flags, _data_flags):
        add_flags(p)
    return p


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Dests of the flags that appear literally in ``argv`` (abbreviations are disabled)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    dests = set()
    for action in parser._actions:
        if any(opt in given for opt in action.option_strings):
            dests.add(action.dest)
    return dests


def _fail(parser: argparse.ArgumentParser, message: str):
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def world_size_from_env(env=os.environ) -> int:
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key):
            return int(env[key])
    return 1


def derive(args) -> None:
    """Compute every derived value (one place). Assumes :func:`validate` passed."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // (tp * pp)
    if args.num_layers_per_virtual_pipeline_stage:
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    else:
        args.virtual_pipeline_model_parallel_size = None
    if args.micro_batch_size and args.global_batch_size:
        args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"


def _validate_grid(err, args) -> None:
    """TP and PP at least 1, and TP x PP divides the world size."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(args, name) < 1:
            err(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if world % (tp * pp):
        err(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}")


def _validate_layout(err, args) -> None:
    """Layers split evenly over PP (x VP); the global batch over micro-batches x DP."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    dp = world // (tp * pp)
    if args.num_layers is not None:
        if args.num_layers % pp:
            err(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
        per_vp = args.num_layers_per_virtual_pipeline_stage
        if per_vp is not None:
            if pp == 1:
                err("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            if per_vp < 1 or args.num_layers % (pp * per_vp):
                err(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                    f"--num-layers-per-virtual-pipeline-stage {per_vp} = {pp * per_vp}")
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if mbs is not None and gbs is not None:
        if gbs % (mbs * dp):
            err(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} "
                f"= {mbs * dp}")
        m = gbs // (mbs * dp)
        if args.num_layers_per_virtual_pipeline_stage is not None and pp > 1 and m % pp:
            err(f"with interleaving, the number of micro-batches {m} (--global-batch-size {gbs} / "
                f"(--micro-batch-size {mbs} x DP {dp})) must be a multiple of --pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel needs --tensor-model-parallel-size > 1; turning it off", stacklevel=3)
        args.sequence_parallel = False


def _validate_model(err, args) -> None:
    """Positive sizes; hidden size, heads and query groups divisible as attention and TP need."""
    tp = args.tensor_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            err(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    h, heads = args.hidden_size, args.num_attention_heads
    if h is not None and h % tp:
        err(f"--hidden-size {h} is not divisible by --tensor-model-parallel-size {tp}")
    if heads is not None:
        if heads % tp:
            err(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
        if h is not None and args.kv_channels is None and h % heads:
            err(f"--hidden-size {h} is not divisible by --num-attention-heads {heads}")
        groups = args.num_query_groups
        if groups is not None:
            if groups < 1 or heads % groups:
                err(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
            if groups % tp:
                err(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    if (args.position_embedding_type == "learned_absolute" and args.seq_length is not None
            and args.max_position_embeddings is not None and args.seq_length > args.max_position_embeddings):
        err(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings} "
            "with learned absolute positions")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        err("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_method is not None and args.recompute_num_layers is None:
        err("--recompute-method needs --recompute-num-layers")


def _validate_run(err, args) -> None:
    """Precision, ZeRO knobs, tokenizer, schedule; a --load folder that does not exist yet is
    Megatron's first run of a requeue script: a warning, then training starts from scratch."""
    if args.fp16 and args.bf16:
        err("--fp16 and --bf16 are mutually exclusive")
    if args.zero_stage not in (0, 1, 2, 3):
        err(f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    for dest in ("zero_reduce_bucket_size", "zero_prefetch_bucket_size",
                 "zero_param_persistence_threshold", "zero_max_live_parameters", "zero_max_reuse_distance"):
        if getattr(args, dest) < 0:
            err(f"--{dest.replace('_', '-')} must be >= 0, got {getattr(args, dest)}")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        err(f"--load {args.load} is not a directory")
    if args.tokenizer_type is not None and args.tokenizer_type not in TOKENIZERS:
        err(f"--tokenizer-type {args.tokenizer_type!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if args.lr_warmup_iters < 0:
        err(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")


def validate(parser, args) -> None:
    """Reject inconsistent flags with one line naming them; warn-and-fix where Megatron does."""
    err = lambda msg: _fail(parser, msg)  # noqa: E731
    for check in (_validate_grid, _validate_model, _validate_layout, _validate_run):
        check(err, args)


def parse_args(argv: list[str] | None = None, world_size: int | None = None, prog: str | None = None):
    """Parse, merge ``--deepspeed-config``, validate and derive. Exits with status 2 on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv, namespace=Arguments())
    args.world_size = world_size if world_size is not None else world_size_from_env()
    if args.group_query_attention and args.num_query_groups is None:
        _fail(parser, "--group-query-attention needs --num-query-groups")
    if args.num_query_groups is not None and not args.group_query_attention:
        # Megatron-LM (core_transformer_config_from_args) ignores the group count without the switch
        _fail(parser, f"--num-query-groups {args.num_query_groups} needs --group-query-attention: without it "
                      "Megatron-LM ignores --num-query-groups and trains multi-head attention; add "
                      "--group-query-attention for GQA, or drop --num-query-groups")
    if args.deepspeed_config:
        apply_deepspeed_config(parser, args, _explicit_dests(parser, argv))
    validate(parser, args)
    derive(args)
    return args.freeze()
