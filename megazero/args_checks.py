"""Validation and derived values of the flags (used by :func:`megazero.arguments.parse_args`).

Each check is ``check(err, args)``: ``err(message)`` exits with status 2 and one
``prog: error: message`` line. Everything here runs before any process group exists, so a bad
flag costs no rank a wait. :func:`derive` computes the derived values, in one place:

* ``world_size`` (set by ``parse_args``), ``data_parallel_size = world / (TP * PP)``
* ``global_batch_size``: ``micro_batch * DP`` unless given (Megatron's default); with
  ``--step-batch-size-schedule`` the schedule's batch size for this run (see below)
* ``num_micro_batches = global_batch / (micro_batch * DP)``
* ``virtual_pipeline_model_parallel_size = num_layers / (PP * layers_per_virtual_stage)``
* ``train_iters`` from ``--train-samples`` (Megatron's ``update_train_iters``: ``samples // B``,
  or with a step schedule the number of batches until ``samples`` are consumed)
* ``lr_decay_iters``: ``train_iters`` unless given; ``params_dtype``; ``distributed_backend``

Batch-size schedules: ``--step-batch-size-schedule "T0:B0 T1:B1 ..."`` (thresholds in tokens,
K/M/B/T suffixes, divided by ``--seq-length`` into samples, Megatron core_v0.19.0) is honoured when
the batch size is constant over this run's samples; a schedule that changes the batch size
within the run is an error (the ZeRO gradient regions reduce after a fixed number of
micro-batches). ``--rampup-batch-size`` is ignored with a warning, as Megatron core_v0.19.0 does.
"""

from __future__ import annotations

import os
import warnings

import torch

TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
              "HuggingFaceTokenizer", "NullTokenizer")  # = megazero.data.tokenizers.TOKENIZER_TYPES


def derive(args) -> None:
    """Compute every derived value (one place). Assumes :func:`validate` passed."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // (tp * pp)
    if args.num_layers_per_virtual_pipeline_stage:
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    else:
        args.virtual_pipeline_model_parallel_size = None
    if args.global_batch_size is None and args.micro_batch_size:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.micro_batch_size and args.global_batch_size:
        args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if args.train_iters is None and args.train_samples is not None and args.global_batch_size:
        b = args.global_batch_size
        args.train_iters = -(-args.train_samples // b) if args.step_batch_size_schedule else args.train_samples // b
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.use_flash_attn:
        args.attention_backend = "flash"


def parse_batch_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2.4e9 // seq_length, 320)]`` sorted by threshold: the
    thresholds are tokens (K/M/B/T suffixes) turned into samples by ``// seq_length``."""
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}

    def number(part: str) -> int:
        part = part.strip().upper()
        mult = scale.get(part[-1:], 1)
        return int(float(part[:-1] if mult > 1 else part) * mult)

    schedule = []
    for entry in text.strip().strip("'\"").replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = (number(x) for x in entry.split(":", 1))
        schedule.append((threshold // seq_length if seq_length else threshold, batch))
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        raise ValueError("the first entry must have threshold 0")
    if any(b[0] <= a[0] for a, b in zip(schedule, schedule[1:])) or any(bs <= 0 for _, bs in schedule):
        raise ValueError("thresholds must increase strictly and batch sizes be positive")
    return schedule


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


def _validate_values(err, args) -> None:
    """Counts that must be positive and rates that must not be negative, named before any work
    (a 0 or negative value would otherwise fail as a division by zero or a misleading message)."""
    for name in ("log_interval", "global_batch_size", "vocab_size", "train_iters", "train_samples",
                 "eval_interval", "save_interval"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            err(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("lr", "min_lr", "eval_iters"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            err(f"--{name.replace('_', '-')} must be >= 0, got {value}")


def _validate_required(err, args) -> None:
    """What a training run cannot start without (Megatron asserts these in validate_args): named
    here, never a TypeError later."""
    missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads",
                                                   "seq_length", "micro_batch_size") if getattr(args, n) is None]
    if missing:
        err(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    if args.train_iters is None and args.train_samples is None:
        err("one of --train-iters or --train-samples is required")
    if args.lr is None and not args.deepspeed_scheduler:
        err("--lr is required (or a --deepspeed-config optimizer/scheduler block)")
    if not (args.data_path or args.mock_data or args.train_data_path):
        err("no training data: give --data-path PREFIX (or --train-data-path ...), or --mock-data with "
            "--vocab-size for synthetic tokens (Megatron-LM requires --mock-data too)")
    if args.save_interval is not None and not args.save:
        warnings.warn(f"--save-interval {args.save_interval} without --save: no checkpoint will be written",
                      stacklevel=4)


def _validate_schedule(err, args) -> None:
    """Iteration- or sample-based, never both (Megatron's rule); warm-up and decay in the same unit."""
    by_iters, by_samples = args.train_iters is not None, args.train_samples is not None
    if by_iters and by_samples:
        err("--train-iters and --train-samples are mutually exclusive")
    if by_iters and (args.lr_decay_samples is not None or args.lr_warmup_samples):
        err("with --train-iters give --lr-decay-iters/--lr-warmup-iters, not --lr-decay-samples/--lr-warmup-samples")
    if by_samples and (args.lr_decay_iters is not None or args.lr_warmup_iters):
        err("with --train-samples give --lr-decay-samples/--lr-warmup-samples, not --lr-decay-iters/--lr-warmup-iters")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        err("--lr-warmup-fraction cannot be combined with --lr-warmup-iters or --lr-warmup-samples")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        err(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    for name in ("lr_warmup_iters", "lr_warmup_samples"):
        if getattr(args, name) < 0:
            err(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        err("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive")
    if args.lr is not None and args.min_lr > args.lr:
        err(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.lr is not None and args.lr_warmup_init > args.lr:
        err(f"--lr-warmup-init {args.lr_warmup_init} exceeds --lr {args.lr}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        err(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")


def _validate_batch_schedule(err, args) -> None:
    """--step-batch-size-schedule: constant over this run, and equal to --global-batch-size if both
    are given (Megatron rejects the pair; its own GPT-3 example passes both, with the schedule's
    final size, so the pair is accepted when they agree about this run)."""
    text = args.step_batch_size_schedule
    if text is None:
        return
    try:
        schedule = parse_batch_schedule(text, args.seq_length)
    except ValueError as e:
        err(f"--step-batch-size-schedule {text!r}: {e}")
    first = schedule[0][1]
    samples = args.train_samples if args.train_samples is not None else (args.train_iters or 0) * first
    changes = [t for t, _ in schedule[1:] if t < samples]
    if changes:
        err(f"--step-batch-size-schedule {text!r} changes the global batch size at sample {changes[0]}, within "
            f"this run's {samples} samples: batch-size changes are not available (ZeRO's gradient regions reduce "
            "after a fixed number of micro-batches); run each constant stretch as its own run with --global-batch-size")
    if args.global_batch_size is not None and args.global_batch_size not in (first, schedule[-1][1]):
        err(f"--global-batch-size {args.global_batch_size} disagrees with --step-batch-size-schedule {text!r}, "
            f"which gives {first} for this run (Megatron-LM refuses the two together; drop one)")
    args.global_batch_size = first


def _validate_features(err, args) -> None:
    """Flags honoured only in some settings (docs/megatron.md says why)."""
    if args.ckpt_format not in ("torch_dist", "torch"):
        err(f"--ckpt-format {args.ckpt_format} is not available: megazero writes its own format, which "
            "reshards on load like torch_dist; use --ckpt-format torch_dist (or torch), and "
            "tools/convert_checkpoint.py to import or export")
    per_split = [f"--{k}-data-path" for k in ("train", "valid", "test") if getattr(args, f"{k}_data_path")]
    if per_split and (args.data_path or args.mock_data):
        err(f"{', '.join(per_split)} with {'--data-path' if args.data_path else '--mock-data'}: give a single "
            "data source (Megatron-LM: one of --mock-data, --data-path, the per-split paths)")
    if per_split and not args.train_data_path:
        err(f"{', '.join(per_split)} without --train-data-path: training needs a train split")
    if args.decoupled_lr is not None and args.deepspeed_scheduler:
        err("--decoupled-lr with a --deepspeed-config scheduler block is not available: drop one of them")
    if args.reset_attention_mask and (args.use_flash_attn or args.attention_backend == "flash"):
        err("--reset-attention-mask with the flash backend is not available (SDPA's flash kernel takes no "
            "mask): use --attention-backend fused (memory-efficient, takes the per-document mask) or auto")
    if args.eod_mask_loss and args.calculate_per_token_loss:
        err("--calculate-per-token-loss with --eod-mask-loss is not available: megazero averages the loss per "
            "micro-batch (Megatron without --calculate-per-token-loss); drop --calculate-per-token-loss")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        err("--no-position-embedding with --position-embedding-type learned_absolute (a GPT without positions) "
            "is not available; use --position-embedding-type rope")


def validate(parser, args, training: bool = False) -> None:
    """Reject inconsistent flags with one line naming them; warn-and-fix where Megatron does.
    ``training``: also require what a training run needs (``pretrain_gpt.py``)."""
    err = lambda msg: parser.exit(2, f"{parser.prog}: error: {msg}\n")  # noqa: E731
    checks = [_validate_grid, _validate_values, _validate_model, _validate_batch_schedule, _validate_layout, _validate_run,
              _validate_schedule, _validate_features]
    for check in checks + ([_validate_required] if training else []):
        check(err, args)
    if args.rampup_batch_size is not None:
        warnings.warn("--rampup-batch-size is ignored, as in Megatron-LM core_v0.19.0 (deprecated there); "
                      "the global batch size is constant (--global-batch-size)", stacklevel=3)
