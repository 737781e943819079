"""The DeepSpeed config keys megazero knows, by what it does with them, and the file reader.

Names and defaults are DeepSpeed 0.19.8's, the current release, checked against the installed
library by tests/peers/test_deepspeed_keys.py (``deepspeed/runtime/constants.py``,
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

# DeepSpeedZeroConfig (0.19.8) sets populate_by_name: a field's own name is accepted where its
# ``stage3_`` alias is. Unprefixed name -> the alias megazero's tables use.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

# (lowest, lowest allowed?, highest) for numeric keys, checked where the value enters (finite
# always). DeepSpeed's own bounds: reduce_bucket_size gt=0, the other ZeRO sizes ge=0
# (zero/config.py Field(...)); batch sizes > 0 (config.py _batch_assertion); torch.optim.AdamW's
# lr, eps, weight_decay >= 0 and 0 <= beta < 1; a scaler's window and hysteresis >= 1.
RANGES = {
    "zero_optimization.reduce_bucket_size": (0, False, None), "gradient_clipping": (0, True, None),
    "optimizer.params.lr": (0, True, None), "optimizer.params.eps": (0, True, None),
    "optimizer.params.weight_decay": (0, True, None), "optimizer.params.betas[0]": (0, True, 1),
    "optimizer.params.betas[1]": (0, True, 1), "fp16.loss_scale": (0, True, None),
    "fp16.initial_scale_power": (0, True, 128), "fp16.loss_scale_window": (1, True, None),
    "fp16.hysteresis": (1, True, None), "fp16.min_loss_scale": (0, False, None),
    "scheduler.params.warmup_min_lr": (0, True, None), "scheduler.params.warmup_max_lr": (0, True, None),
    "scheduler.params.total_num_steps": (0, True, None),
    **{f"zero_optimization.{k}": (0, True, None) for k in ("stage3_prefetch_bucket_size",
       "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")},
}


def range_error(key: str, value: float) -> str | None:
    """Why ``value`` is out of ``key``'s range (:data:`RANGES`; every number must be finite), or None."""
    if value != value or value in (float("inf"), float("-inf")):
        return f"key '{key}' must be a finite number, got {value!r}"
    low, low_ok, high = RANGES.get(key, (None, True, None))
    if low is not None and (value < low or (value == low and not low_ok)):
        return f"key '{key}' must be {'>=' if low_ok else '>'} {low}, got {value!r}"
    if high is not None and value >= high:
        return f"key '{key}' must be < {high}, got {value!r}"
    return None


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
    # accepted by 0.19.8's DeepSpeedZeroConfig, memory layout / debugging only:
    "stage3_allgather_sequential", "parameter_alignment", "enable_sanity_checks", "leaf_module",
    "save_muon_momentum_buffer_in_memory",
}
# compute_grad_norm (0.19.8): true is the default; false skips the norm, allowed by DeepSpeed only
# at stage 1/2 and documented as correct only without clipping -- megazero accepts it there.

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
    "zero_optimization.zenflow": None,
}
BLOCKS_ENABLED_BY_PRESENCE = {"sparse_attention", "compression_training", "weight_quantization",
                              "zero_optimization.zenflow"}
NO_EFFECT_SUBKEYS = {"bf16.immediate_grad_update", "fp16.enabled", "bf16.enabled"}


def check_grad_norm(m, zero: dict) -> None:
    """``compute_grad_norm`` (DeepSpeed 0.19.8): false only at ZeRO 1/2 (its validator) and, as its
    docs say, only without clipping; megazero always computes the norm, so false has no effect."""
    value = zero.pop("compute_grad_norm", True)
    if m.typed("zero_optimization.compute_grad_norm", value, bool):
        return
    stage = m.args.zero_stage if "zero_stage" in m.explicit else zero.get("stage", 0)
    clip = m.args.clip_grad if "clip_grad" in m.explicit else m.config.get("gradient_clipping", 0.0)
    if stage not in (1, 2) or clip:
        m.fail("zero_optimization.compute_grad_norm=false is supported only with ZeRO Stage 1 or 2 and "
               f"without gradient_clipping (stage {stage}, clipping {clip})")
    m.notes["no effect"].append("zero_optimization.compute_grad_norm")


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
# fp32_optimizer_states: engine.get_optimizer_configuration pops it; only its CPU Adam reads it.
OPTIMIZER_NO_EFFECT = {"set_grad_none", "foreach", "fused", "capturable", "differentiable", "fp32_optimizer_states"}

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
    "warmup_max_lr": (float, 0.001, "lr"),  # WarmupLR: None -> the optimizer's lr (0.19.8)
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
