"""The domain of every numeric flag, checked where the value enters (before any process group).

A domain is an interval written as text, ``"[0, 1)"``, ``"(0, inf)"``, ``"[1, inf)"``: brackets
closed, parentheses open. Every value must also be finite: ``inf`` is never a value (it is only
an open upper end here), and NaN compares false with everything, so ``value < 0`` lets it pass;
:func:`domain_problem` tests ``lo <= value`` the other way round, as ``not (value >= lo)``, so
NaN fails every domain. Integers are already integers (argparse's ``int``); a domain says which
integers.

Where the rule comes from, by flag family:

* sizes, counts, intervals, parallel sizes: at least 1 (Megatron asserts these or divides by them);
* probabilities (dropouts): ``[0, 1)`` -- ``torch.nn.Dropout`` accepts 1, which zeroes every
  activation: no Megatron recipe trains that, so it is refused rather than trained silently;
* Adam: ``0 <= beta < 1`` and ``eps >= 0``, the checks of ``torch.optim.AdamW.__init__``;
* rates and coefficients (lr, weight decay, clipping, loss coefficients): ``>= 0``;
* scales and epsilons that divide: ``> 0``; the loss scale's window and hysteresis: ``>= 1``;
* ``--seed``: ``[0, 2**31)`` -- numpy's seeds are ``< 2**32`` and per-rank offsets are added to it;
* timeouts and durations: ``> 0``.

``NOT_NUMERIC`` lists the flags whose argparse type is a parser of its own (checked by it).
"""

from __future__ import annotations

import math

NOT_NUMERIC = {"moe_layer_freq"}  # "1", "[1,0,1]" or "([1]*3+[0])": parsed and checked by moe_flags

_AT_LEAST_1 = """num_layers hidden_size ffn_hidden_size num_attention_heads kv_channels num_query_groups seq_length
max_position_embeddings rotary_base make_vocab_size_divisible_by moe_ffn_hidden_size moe_router_topk
moe_router_num_groups moe_router_group_topk moe_shared_expert_intermediate_size micro_batch_size global_batch_size
train_iters train_samples exit_interval recompute_num_layers lr_decay_iters lr_decay_samples eval_interval
log_interval tensorboard_log_interval tensorboard_queue_size save_interval loss_scale_window hysteresis
tensor_model_parallel_size pipeline_model_parallel_size num_layers_per_virtual_pipeline_stage
context_parallel_size expert_model_parallel_size expert_tensor_parallel_size vocab_size straggler_minmax_count
q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim mtp_num_layers muon_num_ns_steps"""

_AT_LEAST_0 = """num_experts lr_warmup_iters lr_warmup_samples eval_iters num_workers zero_reduce_bucket_size
zero_prefetch_bucket_size zero_param_persistence_threshold zero_max_live_parameters zero_max_reuse_distance
norm_epsilon weight_decay clip_grad adam_eps init_method_std moe_aux_loss_coeff moe_z_loss_coeff
moe_router_bias_update_rate lr min_lr decoupled_lr decoupled_min_lr lr_warmup_init error_injection_rate mscale
mscale_all_dim mtp_loss_scaling_factor"""

_POSITIVE = """moe_router_topk_scaling_factor moe_expert_capacity_factor exit_duration_in_mins loss_scale
initial_loss_scale min_loss_scale distributed_timeout_minutes rotary_scaling_factor muon_extra_scale_factor"""

DOMAINS = {
    **{dest: "[1, inf)" for dest in _AT_LEAST_1.split()},
    **{dest: "[0, inf)" for dest in _AT_LEAST_0.split()},
    **{dest: "(0, inf)" for dest in _POSITIVE.split()},
    "attention_dropout": "[0, 1)", "hidden_dropout": "[0, 1)",
    "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "muon_momentum": "[0, 1)",
    "lr_warmup_fraction": "[0, 1)",
    "seed": f"[0, {2 ** 31})",
    "zero_stage": "[0, 3]",
    "straggler_ctrlr_port": "[1, 65535]",
}

_WHAT = {"[1, inf)": ">= 1", "[0, inf)": ">= 0", "(0, inf)": "> 0", "[0, 1)": "in [0, 1)", "[0, 3]": "0, 1, 2 or 3",
         "[1, 65535]": "a TCP port in [1, 65535]"}


HINTS = {"moe_expert_capacity_factor": "Megatron reads a negative value as dropless: omit the flag for a "
                                      "dropless MoE"}


def parse_interval(text: str) -> tuple[float, float, bool, bool]:
    """``"[0, 1)"`` -> ``(0.0, 1.0, lo_closed=True, hi_closed=False)``."""
    lo_text, hi_text = (part.strip() for part in text[1:-1].split(","))
    return float(lo_text), float(hi_text), text[0] == "[", text[-1] == "]"


def domain_problem(flag: str, value, domain: str) -> str | None:
    """One line naming ``flag`` when ``value`` is not a finite number in ``domain``, else None.
    Written as ``not (lo <= value)`` so that NaN is outside every domain."""
    lo, hi, lo_closed, hi_closed = parse_interval(domain)
    ok = math.isfinite(value) and (value >= lo if lo_closed else value > lo) and \
        (value <= hi if hi_closed else value < hi)
    if ok:
        return None
    what = _WHAT.get(domain, f"in {domain}")
    if not math.isfinite(value):
        return f"{flag} must be a finite number {what}, got {value}"
    return f"{flag} must be {what}, got {value}"


def check_domains(err, args) -> None:
    """Every numeric flag with a value against its domain (a list value: each element)."""
    for dest, domain in DOMAINS.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool):
            continue
        flag = "--" + dest.replace("_", "-")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            problem = domain_problem(flag, item, domain)
            if problem:
                err(problem + (f" ({HINTS[dest]})" if dest in HINTS else ""))
                break
