"""The DeepSpeed config keys megazero knows, by what it does with them, and the file reader.

Names and defaults are DeepSpeed v0.16.4's (``deepspeed/runtime/constants.py``,
``deepspeed/runtime/zero/config.py``, ``deepspeed/runtime/zero/offload_config.py``,
``deepspeed/ops/adam/fused_adam.py``, ``deepspeed/runtime/lr_schedules.py``); docs/zero.md's
"DeepSpeed config keys" section is the same table in prose. Used by
:mod:`megazero.config.deepspeed_config`.
"""

from __future__ import annotations

import json
import os

# Batch keys (solved together, DeepSpeed's arithmetic) -> megazero flag (None: no flag, derived).
BATCH_KEYS = {
    "train_batch_size": "global_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": None,
}

# zero_optimization keys megazero implements -> (flag dest, type, DeepSpeed default).
# overlap_comm's default is computed: true for stage 3, false otherwise (zero/config.py validator).
ZERO_KEYS = {
    "stage": ("zero_stage", int, 0),
    "overlap_comm": ("zero_overlap_comm", bool, None),
    "reduce_bucket_size": ("zero_reduce_bucket_size", int, 500_000_000),
    "stage3_prefetch_bucket_size": ("zero_prefetch_bucket_size", int, 50_000_000),
    "stage3_param_persistence_threshold": ("zero_param_persistence_threshold", int, 100_000),
    "stage3_max_live_parameters": ("zero_max_live_parameters", int, 1_000_000_000),
    "stage3_max_reuse_distance": ("zero_max_reuse_distance", int, 1_000_000_000),
}

# Top-level keys with a megazero flag -> (flag dest, type, DeepSpeed default).
TOP_KEYS = {
    "gradient_clipping": ("clip_grad", float, 0.0),
}

# fp16 keys -> (flag dest, type). initial_scale_power p gives --initial-loss-scale 2**p;
# loss_scale 0 means dynamic (--loss-scale unset).
FP16_KEYS = {
    "initial_scale_power": ("initial_loss_scale", int),
    "loss_scale": ("loss_scale", float),
    "loss_scale_window": ("loss_scale_window", int),
    "hysteresis": ("hysteresis", int),
    "min_loss_scale": ("min_loss_scale", float),
}
# Any of these present -> DeepSpeed builds its dynamic scaler from the config defaults below;
# none present -> each optimizer's own scaler defaults (see fp16_scaler_defaults).
FP16_DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
                     "consecutive_hysteresis")


def fp16_scaler_defaults(fp16_block: dict, stage: int, torch_adam: bool) -> tuple[dict, str]:
    """DeepSpeed's dynamic loss-scaler settings for absent fp16 keys, and where they come from.

    * a dynamic key given: config defaults, power 16, window 1000, min 1, hysteresis 2
      (``get_dynamic_loss_scale_args``); ZeRO stage 0's FP16_Optimizer has no hysteresis (1);
    * none given, ZeRO 1-3: ``DynamicLossScaler()``: 2**32, window 1000, min 1, hysteresis 1;
    * none given, stage 0: FP16_Optimizer 2**16, window 1000, min 1 (unfused, with
      ``torch_adam``: min 0.25), hysteresis 1.
    """
    if any(k in fp16_block for k in FP16_DYNAMIC_KEYS):
        found = dict(initial_scale_power=16, loss_scale_window=1000, min_loss_scale=1.0, hysteresis=2)
        where = "fp16 config defaults"
    elif stage > 0:
        found = dict(initial_scale_power=32, loss_scale_window=1000, min_loss_scale=1.0, hysteresis=1)
        where = "ZeRO DynamicLossScaler defaults"
    else:
        found = dict(initial_scale_power=16, loss_scale_window=1000, min_loss_scale=0.25 if torch_adam else 1.0,
                     hysteresis=1)
        where = "stage-0 FP16_Optimizer defaults"
    if stage == 0:
        found["hysteresis"] = 1
    return found, where


# Keys that only log, profile, monitor or configure DeepSpeed features megazero does not use
# for training (checkpoint I/O, autotuning): listed as "harmless", any value.
HARMLESS_KEYS = {
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler", "tensorboard",
    "wandb", "csv_monitor", "comet", "comms_logger", "timers", "autotuning", "checkpoint", "nebula", "aio",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "vocabulary_size", "dataloader_drop_last",
}

# Keys whose any value leaves megazero's training unchanged (memory/communication layout of
# DeepSpeed's own engine, or features the model does not call): "no effect".
NO_EFFECT_KEYS = {
    "activation_checkpointing",  # DeepSpeed's checkpointing API; megazero: --recompute-*
    "pipeline",  # DeepSpeed's PipelineEngine; megazero: --pipeline-model-parallel-size
    "seq_parallel_comm_data_type", "use_data_before_expert_parallelism",
}
NO_EFFECT_ZERO_KEYS = {
    "contiguous_gradients",  # megazero's gradients always live in contiguous flat buffers
    "allgather_bucket_size",  # megazero's parameter all-gathers follow the reduce buckets
    "allgather_partitions", "reduce_scatter", "sub_group_size", "round_robin_gradients",
    "use_multi_rank_bucket_allreduce", "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
    "legacy_stage1", "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "zero_hpz_partition_size",
    "mics_shard_size", "mics_hierarchical_params_gather", "cpu_offload_use_pin_memory",
}

# Keys accepted only at DeepSpeed's default (any other value changes training -> error).
# For a block, the value compared is its "enabled" (present block without "enabled": enabled
# for sparse_attention / compression_training / weight_quantization).
ONLY_DEFAULT_KEYS = {
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "sparse_gradients": False,
    "communication_data_type": None, "disable_allgather": False, "graph_harvesting": False,
    "amp": False, "progressive_layer_drop": False, "eigenvalue": False, "curriculum_learning": False,
    "data_efficiency": False, "elasticity": False, "hybrid_engine": False, "sparse_attention": False,
    "compression_training": False, "weight_quantization": False, "moe": False,
    "fp16.auto_cast": False, "fp16.fp16_master_weights_and_grads": False, "fp16.consecutive_hysteresis": False,
    "data_types.grad_accum_dtype": None,
    "zero_optimization.zero_quantized_weights": False, "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False, "zero_optimization.zeropp_loco_param": None,
}
BLOCKS_ENABLED_BY_PRESENCE = {"sparse_attention", "compression_training", "weight_quantization"}
NO_EFFECT_SUBKEYS = {"bf16.immediate_grad_update", "fp16.enabled", "bf16.enabled"}


def offload_devices(zero: dict) -> list[str]:
    """The offload settings that move state off the GPU: ``offload_optimizer``/``offload_param``
    with a device other than "none", or the deprecated ``cpu_offload``/``cpu_offload_param``."""
    found = []
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        device = block.get("device", "none") if isinstance(block, dict) else None
        if device not in (None, "none"):
            found.append(f"zero_optimization.{key} (device {device})")
    for key in ("cpu_offload", "cpu_offload_param"):
        if zero.get(key) is True:
            found.append(f"zero_optimization.{key}")
    return found


# optimizer.params megazero reads; the others are errors (DeepSpeed passes them to the
# optimizer's constructor) except those with no effect on the update.
OPTIMIZER_TYPES = ("adam", "adamw")  # DeepSpeed lower-cases its own optimizer names
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad",
                    "maximize"}
OPTIMIZER_NO_EFFECT = {"set_grad_none", "foreach", "fused", "capturable", "differentiable"}

# scheduler.type -> the params DeepSpeed's constructor takes (besides the optimizer).
SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"},
}
# scheduler param -> (type, DeepSpeed default, megazero flag dest that wins when explicit).
SCHEDULER_DEFAULTS = {
    "warmup_min_lr": (float, 0.0, "min_lr"),
    "warmup_max_lr": (float, 0.001, "lr"),
    "warmup_num_steps": (int, 1000, "lr_warmup_iters"),
    "warmup_type": (str, "log", None),
    "total_num_steps": (int, None, "lr_decay_iters"),
    "warmup_min_ratio": (float, 0.0, None),
    "cos_min_ratio": (float, 0.0001, None),
    "last_batch_iteration": (int, -1, None),
}


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate keys: {', '.join(dup)}")
    return dict(pairs)


def load_config(parser, path: str) -> dict:
    """Read the JSON object; duplicate keys are an error, as in DeepSpeed."""
    def fail(message):
        parser.exit(2, f"{parser.prog}: error: --deepspeed-config: {message}\n")
    if not os.path.isfile(path):
        fail(f"file not found: {path}")
    try:
        with open(path) as f:
            config = json.load(f, object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{path} is not valid JSON: {e}")
    except ValueError as e:
        fail(f"{path}: {e}")
    if not isinstance(config, dict):
        fail(f"{path} must hold a JSON object")
    return config
