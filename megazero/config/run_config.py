"""The namespace -> typed configs, in one place (:func:`run_config`).

``parse_args`` validated the flags and derived the layout values; this turns them into the
frozen objects of :mod:`.configs`, one per concern. Only the arguments package reads the
namespace: every other module takes its config.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from megazero.config.batch_schedule import BatchSchedule
from megazero.config.configs import (CheckpointConfig, DataConfig, LoggingConfig, LRConfig, ParallelConfig,
                                     ReliabilityConfig, RunConfig, ScheduleConfig, WandbConfig)
from megazero.config.model import gpt_config
from megazero.config.optimizer import OptimizerConfig
from megazero.data.tokenizers import TokenizerConfig
from megazero.moe.config import MOE_ARG_KEYS


def parallel_config(args) -> ParallelConfig:
    """The rank grid: TP, PP (and VP), EP and ETP (``--expert-tensor-parallel-size``, TP unless
    given). CP is 1 (its Megatron flag is refused above 1 for now)."""
    tp = args.tensor_model_parallel_size
    return ParallelConfig(world_size=args.world_size, tp=tp, pp=args.pipeline_model_parallel_size,
                          vp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
                          ep=args.expert_model_parallel_size,
                          etp=args.expert_tensor_parallel_size or tp,
                          sequence_parallel=args.sequence_parallel, backend=args.distributed_backend,
                          timeout_minutes=args.distributed_timeout_minutes,
                          pipeline_schedule=args.pipeline_schedule)


def tokenizer_config(args) -> TokenizerConfig:
    return TokenizerConfig(type=args.tokenizer_type, model=args.tokenizer_model, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, vocab_size=args.vocab_size)


def data_config(args) -> DataConfig:
    """Datasets and micro-batches; mock data when ``--mock-data`` or no data path at all."""
    per_split = tuple(tuple(p) if p else None for p in (args.train_data_path, args.valid_data_path,
                                                        args.test_data_path))
    per_split = per_split if any(per_split) else None
    return DataConfig(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                      tokenizer=tokenizer_config(args),
                      data_path=tuple(args.data_path) if args.data_path else None, split=args.split,
                      per_split_paths=per_split, mock=bool(args.mock_data or not (args.data_path or per_split)),
                      vocab_size=args.vocab_size, cache_path=args.data_cache_path, seed=args.seed,
                      num_workers=args.num_workers, eod_mask_loss=args.eod_mask_loss,
                      reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask)


def lr_config(args) -> LRConfig:
    """Megatron's schedule in samples (``B = --global-batch-size``): decay ``D = --lr-decay-iters x
    B`` (default ``--train-iters``) or ``--lr-decay-samples`` (default ``--train-samples``);
    warm-up ``--lr-warmup-iters x B`` or ``--lr-warmup-samples``, or ``--lr-warmup-fraction x D``."""
    b = args.global_batch_size
    if args.train_samples is None:
        decay = (args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters or 0) * b
        warmup = args.lr_warmup_iters * b
    else:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    ds = args.deepspeed_scheduler
    return LRConfig(lr=args.lr, min_lr=args.min_lr, decay_style=args.lr_decay_style, warmup_samples=warmup,
                    decay_samples=decay, warmup_init=args.lr_warmup_init, samples_per_step=b,
                    override=args.override_opt_param_scheduler, use_checkpoint=args.use_checkpoint_opt_param_scheduler,
                    decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                    deepspeed_scheduler=MappingProxyType(dict(ds)) if ds else None)


def schedule_config(args) -> ScheduleConfig:
    return ScheduleConfig(train_iters=args.train_iters, batches=BatchSchedule.from_args(args),
                          global_batch_size=args.global_batch_size, num_micro_batches=args.num_micro_batches,
                          lr=lr_config(args), train_samples=args.train_samples, eval_iters=args.eval_iters,
                          eval_interval=args.eval_interval, exit_interval=args.exit_interval,
                          exit_duration_in_mins=args.exit_duration_in_mins,
                          exit_signal_handler=args.exit_signal_handler, exit_signal=args.exit_signal)


def checkpoint_config(args) -> CheckpointConfig:
    return CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                            async_save=args.async_save, save_optim=not args.no_save_optim,
                            save_rng=not args.no_save_rng, load_optim=not args.no_load_optim,
                            load_rng=not args.no_load_rng, finetune=args.finetune,
                            exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                            overwrite=args.overwrite_checkpoints, ckpt_format=args.ckpt_format)


def logging_config(args) -> LoggingConfig:
    wandb = WandbConfig(project=args.wandb_project, exp_name=args.wandb_exp_name, save_dir=args.wandb_save_dir,
                        entity=args.wandb_entity)
    return LoggingConfig(log_interval=args.log_interval, throughput=args.log_throughput,
                         params_norm=args.log_params_norm, num_zeros_in_grad=args.log_num_zeros_in_grad,
                         tensorboard_dir=args.tensorboard_dir, tensorboard_log_interval=args.tensorboard_log_interval,
                         tensorboard_queue_size=args.tensorboard_queue_size,
                         timers_to_tensorboard=args.log_timers_to_tensorboard,
                         loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard,
                         validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
                         memory_to_tensorboard=args.log_memory_to_tensorboard,
                         world_size_to_tensorboard=args.log_world_size_to_tensorboard,
                         pipeline_trace=args.pipeline_trace, debug=args.debug, wandb=wandb)


def reliability_config(args) -> ReliabilityConfig:
    """The result checks and straggler reports (fp16's dynamic loss scaling already turned the NaN
    check off in ``derive``, as Megatron-LM)."""
    return ReliabilityConfig(rerun_mode=args.rerun_mode, check_nan=args.check_for_nan_in_loss_and_grad,
                             check_spiky_loss=args.check_for_spiky_loss, check_large_grads=args.check_for_large_grads,
                             error_injection_rate=args.error_injection_rate,
                             error_injection_type=args.error_injection_type,
                             on_transient=args.rerun_on_transient_error, log_straggler=args.log_straggler,
                             straggler_port=args.straggler_ctrlr_port,
                             straggler_minmax_count=args.straggler_minmax_count,
                             straggler_on_startup=not args.disable_straggler_on_startup)


def jsonable_flags(args) -> dict:
    """The JSON-representable flag values by ``dest`` name, sorted (dtypes by name; private names
    and other values dropped): a checkpoint's ``args`` record, Megatron's names."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out


def recorded_flags(args, model) -> dict:
    """:func:`jsonable_flags`, without the MoE settings when the model is dense: a checkpoint
    records ``{**flags, **model.to_args()}`` and a dense ``to_args`` holds ``num_experts`` None
    only, so ``--moe-layer-freq``'s default must not read as a shape of the saved model."""
    flags = jsonable_flags(args)
    if model.moe is None:
        flags = {k: v for k, v in flags.items() if k == "num_experts" or k not in MOE_ARG_KEYS}
    return flags


def run_config(args, vocab_size: int) -> RunConfig:
    """Every config of a run from ``parse_args``' validated namespace; ``vocab_size``: the
    tokenizer's (or ``--vocab-size`` with mock data). The model's sizes are checked against TP
    (the experts' against ETP)."""
    model, parallel = gpt_config(args, vocab_size=vocab_size), parallel_config(args)
    model.check_tp(parallel.tp, parallel.etp)
    return RunConfig(model=model, parallel=parallel, optimizer=OptimizerConfig.from_args(args),
                     data=data_config(args), schedule=schedule_config(args), checkpoint=checkpoint_config(args),
                     logging=logging_config(args), seed=args.seed, attention_backend=args.attention_backend,
                     gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                     reliability=reliability_config(args), host_memory_policy=args.zero_host_memory_policy,
                     flags=MappingProxyType(recorded_flags(args, model)))
