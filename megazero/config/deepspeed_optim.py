"""The ``optimizer`` and ``scheduler`` blocks of a DeepSpeed config (used by megazero.config.deepspeed_config).

Optimizer (DeepSpeed 0.19.8 ``engine._configure_basic_optimizer``): ``type`` Adam or AdamW
(case-insensitive); ``adam_w_mode`` (default true) — the effective mode is
``type == AdamW or adam_w_mode``, so only ``Adam`` with ``adam_w_mode: false`` is Adam with L2
decay (``args.adam_w_mode = False``: ZeroOptimizer's ``decoupled_weight_decay``). ``torch_adam``
selects torch.optim.Adam/AdamW instead of FusedAdam: same update, but torch.optim.AdamW's
weight-decay default is 0.01 where FusedAdam's is 0. Defaults: lr 1e-3, betas (0.9, 0.999),
eps 1e-8. Without an optimizer block the Megatron flags (``--lr``...) are the client optimizer.

Scheduler (``deepspeed/runtime/lr_schedules.py`` 0.19.8): WarmupLR, WarmupDecayLR, WarmupCosineLR
with DeepSpeed's parameter names and defaults (WarmupLR without ``warmup_max_lr``: the optimizer's
lr; ``warmup_num_steps`` a positive JSON integer); OneCycle and LRRangeTest are refused -> ``args.deepspeed_scheduler`` (keywords of
``megazero.optim.lr_schedule.DeepSpeedLRScheduler``). Explicit ``--lr``, ``--min-lr``,
``--lr-warmup-iters``, ``--lr-decay-iters`` replace warmup_max_lr, warmup_min_lr,
warmup_num_steps, total_num_steps; an explicit ``--lr-decay-style`` replaces the whole block
with Megatron's schedule. Without a scheduler block the Megatron flags' schedule is used (the
client scheduler, as Megatron-DeepSpeed passes it).
"""

from __future__ import annotations

from megazero.config.deepspeed_muon import apply_muon
from megazero.config.deepspeed_keys import (OPTIMIZER_NO_EFFECT, OPTIMIZER_PARAMS, OPTIMIZER_TYPES, SCHEDULER_DEFAULTS,
                                     SCHEDULER_PARAMS)

MUST_BE = {"bias_correction": True, "amsgrad": False, "maximize": False}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_params(m, params: dict) -> None:
    if "max_grad_norm" in params:
        m.fail("'max_grad_norm' is not supported as an optimizer parameter, please switch to using the "
               "deepspeed parameter 'gradient_clipping' (DeepSpeed's own error)")
    for name, value in params.items():
        key = f"optimizer.params.{name}"
        if name in OPTIMIZER_NO_EFFECT:
            m.notes["no effect"].append(key)
        elif name not in OPTIMIZER_PARAMS:
            m.fail(f"key '{key}' is not a parameter of DeepSpeed's Adam/AdamW (its constructor would reject it)")
        elif name in MUST_BE and value != MUST_BE[name]:
            m.fail(f"key '{key}' = {value!r} changes training and is not available in megazero "
                   f"(only {MUST_BE[name]!r}, the default)")


def apply_optimizer(m) -> dict:
    """Resolve the optimizer block into --lr, --adam-beta1/2, --adam-eps, --weight-decay and
    ``args.adam_w_mode``. Returns ``{"present": bool, "torch_adam": bool}``."""
    args = m.args
    block = m.block("optimizer", m.config.get("optimizer"))
    if not block:
        return {"present": False, "torch_adam": False}
    kind = block.get("type")
    if isinstance(kind, str) and kind.lower() == "muon":  # DeepSpeed 0.19.8's Muon: config/deepspeed_muon.py
        apply_muon(m, m.block("optimizer.params", block.get("params")))
        return {"present": True, "torch_adam": False}
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_TYPES:
        m.fail(f"optimizer.type {kind!r} is not available in megazero; use Adam, AdamW or Muon")
    for key in block:
        if key not in ("type", "params"):
            m.notes["no effect" if key == "legacy_fusion" else "unknown, not read"].append(f"optimizer.{key}")
    params = m.block("optimizer.params", block.get("params"))
    _check_params(m, params)
    for name in ("torch_adam", "adam_w_mode"):
        if params.get(name) == "auto":
            m.unresolved.append(f"optimizer.params.{name} (no megazero flag)")
    raw = params.get("torch_adam", False)
    torch_adam = raw != "auto" and m.typed("optimizer.params.torch_adam", raw, bool)
    mode = params.get("adam_w_mode", True)
    mode = True if mode == "auto" else m.typed("optimizer.params.adam_w_mode", mode, bool)
    args.adam_w_mode = kind.lower() == "adamw" or mode
    m.record("config", "optimizer.type", kind)
    m.record("config" if "adam_w_mode" in params else "DeepSpeed default", "adam_w_mode (effective)", args.adam_w_mode)
    m.take("optimizer.params.lr", "lr", params, "lr", float, default=1e-3)
    m.take("optimizer.params.eps", "adam_eps", params, "eps", float, default=1e-8)
    m.take("optimizer.params.weight_decay", "weight_decay", params, "weight_decay", float,
           default=0.01 if torch_adam and args.adam_w_mode else 0.0)
    betas = params.get("betas", (0.9, 0.999))
    if betas != "auto" and (not isinstance(betas, (list, tuple)) or len(betas) != 2):
        m.fail(f"key 'optimizer.params.betas' must be a list of two numbers, got {betas!r}")
    for i, dest in enumerate(("adam_beta1", "adam_beta2")):
        given = {"betas": betas if betas == "auto" else betas[i]} if "betas" in params else {}
        m.take(f"optimizer.params.betas[{i}]", dest, given, "betas", float, default=(0.9, 0.999)[i])
    return {"present": True, "torch_adam": torch_adam}


def _scheduler_value(m, kind: str, name: str, params: dict):
    """One scheduler parameter: explicit flag, config value ("auto": the flag), DeepSpeed default."""
    typ, default, dest = SCHEDULER_DEFAULTS[name]
    key, args = f"scheduler.params.{name}", m.args
    if name == "total_num_steps" and dest not in m.explicit and params.get(name) == "auto":
        dest = "lr_decay_iters" if args.lr_decay_iters is not None else "train_iters"
    if dest and dest in m.explicit:
        if params.get(name, "auto") != "auto":
            m.typed(key, params[name], typ)  # overridden, but still a valid value
        m.record("command line", key, getattr(args, dest), dest)
        return getattr(args, dest)
    if params.get(name) == "auto":
        if dest is None or getattr(args, dest) is None:
            m.unresolved.append(f"{key} ({_flag(dest) if dest else 'no megazero flag'})")
            return None
        m.record("auto", key, getattr(args, dest), dest)
        return getattr(args, dest)
    if name in params:
        value = m.typed(key, params[name], typ)
        if name == "warmup_num_steps" and (not isinstance(params[name], int) or value <= 0):
            m.fail(f"key '{key}' must be a positive integer, got {params[name]!r} (DeepSpeed's own check)")
        m.record("config", key, value)
        return value
    if kind == "WarmupLR" and name == "warmup_max_lr":  # 0.19.8: None -> the optimizer's lr
        if args.lr is None:
            m.fail("WarmupLR without scheduler.params.warmup_max_lr takes the optimizer's lr: give --lr or "
                   "optimizer.params.lr")
        m.record("DeepSpeed default", key + " (the optimizer's lr)", args.lr)
        return args.lr
    if default is None:
        m.fail(f"{kind} needs scheduler.params.{name} (DeepSpeed's constructor requires it) or {_flag(dest)}")
    m.record("DeepSpeed default", key, default)
    return default


def _check_scheduler(m, kind: str, s: dict) -> None:
    if s.get("warmup_type") not in (None, "log", "linear"):
        m.fail(f"scheduler.params.warmup_type must be 'log' or 'linear', got {s['warmup_type']!r} "
               "(DeepSpeed would fall back to 'log' with a warning)")
    if s.pop("last_batch_iteration", -1) not in (-1, None):
        m.fail("scheduler.params.last_batch_iteration must be -1: resume the schedule from a checkpoint (--load)")
    if kind == "WarmupCosineLR" and "min_lr" in m.explicit:
        m.fail("--min-lr has no WarmupCosineLR counterpart; set scheduler.params.cos_min_ratio")
    if s.get("warmup_num_steps") is not None and s["warmup_num_steps"] <= 0 and not m.unresolved:
        m.fail(f"warmup_num_steps must be a positive integer, got {s['warmup_num_steps']} (DeepSpeed's own check)")


def apply_scheduler(m, opt: dict) -> None:
    """Resolve the scheduler block into ``args.deepspeed_scheduler`` (None: Megatron's schedule)."""
    args = m.args
    args.deepspeed_scheduler = None
    block = m.block("scheduler", m.config.get("scheduler"))
    if block and "lr_decay_style" in m.explicit:
        m.record("command line", "scheduler", args.lr_decay_style, "lr_decay_style")
        m.notes["no effect"].append(f"scheduler {block.get('type')} (replaced by --lr-decay-style)")
        block = {}
    kind = block.get("type")
    lr_pending = any(u.startswith("optimizer.params.lr ") for u in m.unresolved)
    if (not block or kind == "WarmupCosineLR") and args.lr is None and not lr_pending:
        m.fail("--lr is required: the config has no optimizer block (optimizer.params.lr) "
               + ("and WarmupCosineLR scales the optimizer's lr" if block else "and no scheduler block"))
    if not block:
        return
    if kind not in SCHEDULER_PARAMS:
        m.fail(f"scheduler.type {kind!r} is not available in megazero; use one of {', '.join(SCHEDULER_PARAMS)}"
               + (" (DeepSpeed has it; megazero does not implement it)" if kind in ("OneCycle", "LRRangeTest") else ""))
    params = m.block("scheduler.params", block.get("params"))
    for name in params:
        if name not in SCHEDULER_PARAMS[kind]:
            m.fail(f"key 'scheduler.params.{name}' is not a parameter of {kind} (DeepSpeed's constructor "
                   "would reject it)")
    settings = {name: _scheduler_value(m, kind, name, params) for name in sorted(SCHEDULER_PARAMS[kind])}
    _check_scheduler(m, kind, settings)
    if kind == "WarmupCosineLR":
        settings["base_lr"] = args.lr
    elif args.lr is None and not opt["present"]:
        args.lr = settings["warmup_max_lr"]  # the optimizer's initial rate; the schedule sets every step's
    m.record("config", "scheduler.type", kind)
    args.deepspeed_scheduler = {"type": kind, **settings}
