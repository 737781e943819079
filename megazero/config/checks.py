"""Validation and derived values of the flags (used by :func:`megazero.arguments.parse_args`).

Each check is ``check(err, args)``: ``err(message)`` records one problem and the check goes on
(a line that needs an earlier one to hold is skipped when it does not), so :func:`validate`
lists every problem in one ``prog: error: A; B; ...`` line and exits with status 2. Everything
here runs before any process group exists, so a bad flag costs no rank a wait. :func:`derive` computes the derived values, in one place:

* ``world_size`` (set by ``parse_args``), ``data_parallel_size = world / (TP * PP)``
* ``global_batch_size``: ``micro_batch * DP`` unless given (Megatron's default); with
  ``--step-batch-size-schedule`` the schedule's batch size for this run (see below)
* ``num_micro_batches = global_batch / (micro_batch * DP)``
* ``virtual_pipeline_model_parallel_size = num_layers / (PP * layers_per_virtual_stage)``
* ``train_iters`` from ``--train-samples``: Megatron's ``update_train_iters`` for the run's
  :class:`~megazero.config.batch_schedule.BatchSchedule` (constant ``samples // B``; step
  schedule: iterations until ``samples`` are consumed; ramp-up: Megatron-LM core_v0.17.1's count)
* ``lr_decay_iters``: ``train_iters`` unless given; ``params_dtype``; ``distributed_backend``
* ``expert_tensor_parallel_size``: TP unless given; ``num_experts`` 0 -> None (dense); a one-entry
  ``moe_router_load_balancing_type`` / ``moe_aux_loss_coeff`` list -> its value (Megatron's
  ``validate_args``; :func:`megazero.config.moe_flags.derive_moe`)

Batch-size schedules (:mod:`megazero.config.batch_schedule`): ``--step-batch-size-schedule``
(Megatron core_v0.19.0) and ``--rampup-batch-size START INCR SAMPLES`` (Megatron core_v0.17.1, the
last release that honours it; it needs ``--train-samples`` there and here). Every size the run
will see must divide by ``micro_batch * DP``: checked here, naming the flag.
"""

from __future__ import annotations

import warnings

import torch

from megazero.config.batch_schedule import BatchSchedule, parse_batch_schedule
from megazero.config.cp_flags import check_cp, derive_cp, model_parallel_product
from megazero.config.mla_flags import check_mla
from megazero.config.moe_flags import check_moe, check_moe_training, derive_moe
from megazero.config.mtp_flags import check_mtp
from megazero.config.pipeline_flags import check_pipeline_schedule, derive_pipeline
from megazero.config.muon_flags import check_muon
from megazero.config.domains import check_domains
from megazero.config.reliability_flags import check_reliability, derive_reliability
from megazero.config.run_checks import check_required, check_run, check_sample_counts
from megazero.config.rank import current_rank
from megazero.model.config import checked_window


def resolve_aliases(args) -> None:
    """Megatron's flags that name something megazero has under another name, resolved into that
    flag (the one place; before a DeepSpeed config is merged and the flags are checked):
    ``--use-distributed-optimizer`` is ZeRO stage 1 at least; ``--overlap-grad-reduce`` and
    ``--overlap-param-gather`` turn on ``--zero-overlap-comm``; ``--recompute-activations`` is
    ``--recompute-granularity selective``; ``--data-args-path FILE`` gives ``--data-path`` its
    contents; a quoted ``--split '99,1,0'`` (a launch script's) loses its quotes."""
    if args.use_distributed_optimizer and args.zero_stage == 0:
        args.zero_stage = 1
    if args.overlap_grad_reduce or args.overlap_param_gather:
        args.zero_overlap_comm = True  # both overlaps follow --zero-overlap-comm (on by default)
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.data_args_path:
        with open(args.data_args_path) as f:
            args.data_path = f.read().split()
    if isinstance(args.split, str):
        args.split = args.split.strip().strip("'\"")


def derive(args) -> None:
    """Compute every derived value (one place). Assumes :func:`validate` passed."""
    pp = args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // model_parallel_product(args)  # CP excluded, as Megatron
    derive_cp(args)
    if args.num_layers_per_virtual_pipeline_stage and args.num_layers is not None:
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    else:
        args.virtual_pipeline_model_parallel_size = None
    derive_pipeline(args)  # --pipeline-schedule zbv/dualpipev: two chunks per rank, implied
    if args.global_batch_size is None and args.micro_batch_size:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.micro_batch_size and args.global_batch_size:
        args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if args.train_iters is None and args.train_samples is not None and args.micro_batch_size:
        args.train_iters = BatchSchedule.from_args(args).train_iters(args.train_samples)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.use_flash_attn:
        args.attention_backend = "flash"
    derive_moe(args)  # Megatron's: --num-experts 0 is dense, ETP defaults to TP
    derive_reliability(args)  # Megatron's: fp16 with dynamic loss scaling turns the NaN check off


def _validate_grid(err, args) -> None:
    """TP x CP x PP divides the world size (each at least 1: :mod:`.domains`)."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    if grid_valid(args) is False:
        cp = args.context_parallel_size
        err(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}{f' x --context-parallel-size {cp}' if cp > 1 else ''} = "
            f"{model_parallel_product(args)}")


def grid_valid(args) -> bool | None:
    """None when TP, PP or CP is < 1 (no grid to check against), else whether TP x CP x PP
    divides the world."""
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size)
    return None if min(sizes) < 1 else args.world_size % model_parallel_product(args) == 0


def _validate_layout(err, args) -> None:
    """Layers split evenly over PP (x VP); the global batch over micro-batches x DP; the sequence
    over TP with --sequence-parallel (Megatron's rule: the sequence dimension is scattered over TP)."""
    if not grid_valid(args):
        return
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    dp = world // model_parallel_product(args)
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
    if mbs is not None and mbs >= 1 and gbs is not None:
        if gbs % (mbs * dp):
            err(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} "
                f"= {mbs * dp}")
        m = gbs // (mbs * dp)
        if (args.num_layers_per_virtual_pipeline_stage is not None and pp > 1 and m % pp
                and args.pipeline_schedule in (None, "interleaved-1f1b")):
            err(f"with interleaving, the number of micro-batches {m} (--global-batch-size {gbs} / "
                f"(--micro-batch-size {mbs} x DP {dp})) must be a multiple of --pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel needs --tensor-model-parallel-size > 1; turning it off", stacklevel=3)
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length is not None and args.seq_length % tp:
        err(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by --tensor-model-parallel-size {tp}")


def _validate_pipeline(err, args) -> None:
    """``--pipeline-schedule`` (:mod:`megazero.config.pipeline_flags`), with the M the run sees."""
    ok = grid_valid(args) and args.micro_batch_size is not None and args.micro_batch_size >= 1
    check_pipeline_schedule(err, args, args.world_size // model_parallel_product(args) if ok else None)


def _validate_model(err, args) -> None:
    """Hidden size, heads and query groups divisible as attention and TP need (sizes >= 1: :mod:`.domains`)."""
    tp = args.tensor_model_parallel_size
    h, heads = args.hidden_size, args.num_attention_heads
    tp = tp if tp >= 1 else 1  # TP < 1 is _validate_grid's problem
    heads = heads if heads is None or heads >= 1 else None  # so is a head count < 1: nothing to divide by
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
    try:
        checked_window(args.window_size)  # --window-size (left, right): causal, left >= -1
    except ValueError as e:
        err(str(e))
    if args.recompute_method is not None and args.recompute_granularity != "full":
        err("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_method is not None and args.recompute_num_layers is None:
        err("--recompute-method needs --recompute-num-layers")


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
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        err("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive")
    lr = args.lr if args.lr is not None and args.lr >= 0 else None  # a negative or NaN --lr is .domains' problem
    if lr is not None and args.min_lr > lr:
        err(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if lr is not None and args.lr_warmup_init > lr:
        err(f"--lr-warmup-init {args.lr_warmup_init} exceeds --lr {args.lr}")


def _validate_batch_schedule(err, args) -> None:
    """--step-batch-size-schedule / --rampup-batch-size (:mod:`megazero.config.batch_schedule`):
    well formed; ramp-up only in a --train-samples run and not with a step schedule (Megatron-LM
    core_v0.17.1 ``validate_args``); a step schedule with --global-batch-size only when they agree
    (Megatron refuses the pair; its own GPT-3 example passes both, with the schedule's final
    size); every size the run will see divisible by micro-batch x DP. ``--global-batch-size``
    keeps Megatron's meaning (default micro-batch x DP): the evaluation batch and the unit of
    ``--lr-decay-iters``/``--lr-warmup-iters``; the ramp-up's final size."""
    text, rampup = args.step_batch_size_schedule, args.rampup_batch_size
    if text is None and rampup is None:
        return
    if rampup is not None and (text is not None or args.train_iters is not None or len(rampup) != 3):
        err("--rampup-batch-size takes START INCREMENT SAMPLES, needs --train-samples and excludes "
            "--step-batch-size-schedule (Megatron-LM core_v0.17.1: 'expected no batch-size rampup for "
            "iteration-based training'); use --step-batch-size-schedule with --train-iters")
        return
    if text is not None:
        try:
            steps = parse_batch_schedule(text, args.seq_length)
        except ValueError as e:
            err(f"--step-batch-size-schedule {text!r}: {e}")
            return
        if args.global_batch_size is not None and args.global_batch_size not in (steps[0][1], steps[-1][1]):
            err(f"--global-batch-size {args.global_batch_size} disagrees with --step-batch-size-schedule {text!r} "
                f"(Megatron-LM refuses the two together; drop one)")
    pp = args.pipeline_model_parallel_size
    if not grid_valid(args) or not args.micro_batch_size or args.micro_batch_size < 1:
        return
    try:
        schedule = BatchSchedule.from_args(args, data_parallel_size=args.world_size // model_parallel_product(args))
        iters = args.train_iters if args.train_iters is not None else schedule.train_iters(args.train_samples or 0)
        schedule.check(iters, pp, interleaved=args.num_layers_per_virtual_pipeline_stage is not None)
    except ValueError as e:
        err(str(e))


def _validate_features(err, args) -> None:
    """Flags honoured only in some settings (docs/megatron.md says why)."""
    if args.ckpt_format not in ("torch_dist", "torch", "torch_dcp"):
        err(f"--ckpt-format {args.ckpt_format} is not available: megazero writes its own format, which "
            "reshards on load like torch_dist, or torch_dcp (a PyTorch DCP folder); use --ckpt-format "
            "torch_dist (or torch, torch_dcp), and tools/convert_checkpoint.py to import or export")
    dcp_without = [f for f, on in (("--async-save", args.async_save), ("--num-experts", args.num_experts),
                                   ("--multi-latent-attention", args.multi_latent_attention),
                                   ("--mtp-num-layers", args.mtp_num_layers)) if on]
    if args.ckpt_format == "torch_dcp" and dcp_without:  # DCP's keys are transformers' names: none for these here
        err(f"--ckpt-format torch_dcp with {dcp_without[0]} is not available: use --ckpt-format torch_dist")
    per_split = [f"--{k}-data-path" for k in ("train", "valid", "test") if getattr(args, f"{k}_data_path")]
    if per_split and (args.data_path or args.mock_data):
        err(f"{', '.join(per_split)} with {'--data-path' if args.data_path else '--mock-data'}: give a single "
            "data source (Megatron-LM: one of --mock-data, --data-path, the per-split paths)")
    if per_split and not args.train_data_path:
        err(f"{', '.join(per_split)} without --train-data-path: training needs a train split")
    if args.decoupled_lr is not None and args.deepspeed_scheduler:
        err("--decoupled-lr with a --deepspeed-config scheduler block is not available: drop one of them")
    for flag, on in (("--reset-attention-mask", args.reset_attention_mask), ("--window-size", bool(args.window_size) and args.window_size[0] != -1)):
        if on and (args.use_flash_attn or args.attention_backend == "flash"):
            err(f"{flag} with the flash backend is not available (SDPA's flash kernel takes no mask): use "
                "--attention-backend fused (memory-efficient, takes the mask) or auto")
    if args.eod_mask_loss and args.calculate_per_token_loss:
        err("--calculate-per-token-loss with --eod-mask-loss is not available: megazero averages the loss per "
            "micro-batch (Megatron without --calculate-per-token-loss); drop --calculate-per-token-loss")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        err("--no-position-embedding with --position-embedding-type learned_absolute (a GPT without positions) "
            "is not available; use --position-embedding-type rope")


class _Stop(Exception):
    """Raised by the ``err`` of a check that stops at its first problem (see :func:`_first_only`)."""


def _first_only(check):
    """``check`` with an ``err`` that records the problem and stops it: for a check whose later
    lines use what an earlier, failed line computed (the parsed batch-size schedule)."""
    def run(err, args):
        def stop(message):
            err(message)
            raise _Stop
        try:
            check(stop, args)
        except _Stop:
            pass
    return run


def problems_of(args, training: bool = False, extra_checks=()) -> list[str]:
    """Every problem the checks find, in order: each numeric flag's domain (:mod:`.domains`; a
    flag outside it is named once, by that line), the grid, what a run needs after the flags'
    own rules, then ``extra_checks`` (``pretrain_gpt.py``: the paths it names)."""
    problems = []
    check_domains(problems.append, args)
    outside = [p.split(" ", 1)[0] for p in problems]  # the flags whose value is outside its domain
    checks = [_validate_grid, _validate_model, _first_only(_validate_batch_schedule),
              _validate_layout, _validate_pipeline, check_run, _validate_schedule, _validate_features, check_moe,
              check_cp, check_reliability, check_mla, check_mtp, check_muon]
    more = [check_required, check_moe_training, check_sample_counts] if training else []
    for check in checks + more + list(extra_checks):
        found = []
        try:
            check(found.append, args)
        except (ArithmeticError, TypeError, ValueError):
            if not outside:
                raise
            continue  # it computed with a value already named above (a size of 0, a NaN)
        problems += [p for p in found if p.split(" ", 1)[0] not in outside]  # each flag named once
    return problems


def report(parser, problems: list[str]) -> None:
    """Exit with status 2 and one ``prog: error: A; B; ...`` line when there are problems."""
    if problems:
        parser.exit(2, f"{parser.prog}: error: {'; '.join(problems)}\n")


def validate(parser, args, training: bool = False, extra_checks=(), problems=()) -> None:
    """Reject inconsistent flags, listing every problem (after ``problems`` found while parsing)
    in one line; warn-and-fix where Megatron does. ``training``: also require what a training run
    needs (``pretrain_gpt.py``)."""
    report(parser, list(problems) + problems_of(args, training, extra_checks))
    if args.rampup_batch_size is not None and current_rank() == 0:
        print(BatchSchedule.from_args(args, data_parallel_size=1).describe(), flush=True)  # core_v0.18+ ignores it
