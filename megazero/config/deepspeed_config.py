"""A DeepSpeed ``ds_config.json`` merged into the Megatron-style flags, as DeepSpeed reads it.

``apply_deepspeed_config(parser, args, explicit)`` runs inside ``arguments.parse_args`` before
validation and before any process group. Precedence for a value that has a megazero flag:

1. the flag, when given explicitly on the command line;
2. the config's value; ``"auto"`` (Hugging Face Trainer convention) takes the flag's value, and
   every ``"auto"`` that has no value is named in one error;
3. DeepSpeed's default when the key is absent (0.19.8; the tables are in
   :mod:`megazero.config.deepspeed_keys`, the prose in docs/zero.md, "DeepSpeed config keys").

Batch: ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * DP``;
missing ones are derived with DeepSpeed's floor divisions, then the identity is checked with
DeepSpeed's message. ``optimizer`` (Adam/AdamW -> ``args.adam_w_mode``) and ``scheduler``
(-> ``args.deepspeed_scheduler``) are resolved by :mod:`megazero.config.deepspeed_optim`. Offloading
is refused with the planner's per-rank memory. Every problem is one ``prog: error: ...`` line,
exit status 2. Rank 0 prints one line saying where each value came from and warns once about
keys that are harmless, have no effect, or are unknown.
"""

from __future__ import annotations

import json
import math
import os
import warnings

from megazero.config.cp_flags import model_parallel_product
from megazero.config.deepspeed_keys import (BATCH_KEYS, BLOCKS_ENABLED_BY_PRESENCE, FP16_KEYS, HARMLESS_KEYS,
                                     NO_EFFECT_KEYS, NO_EFFECT_SUBKEYS, NO_EFFECT_ZERO_KEYS, ONLY_DEFAULT_KEYS,
                                     TOP_KEYS, ZERO_ALIASES, ZERO_KEYS, check_grad_norm, fp16_scaler_defaults,
                                     load_config, offload_devices, range_error)
from megazero.config.deepspeed_optim import apply_optimizer, apply_scheduler
from megazero.config.rank import current_rank

SOURCE_ORDER = ("command line", "config", "auto", "DeepSpeed default")
HANDLED = {"optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "bfloat16", *BATCH_KEYS, *TOP_KEYS}


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class Merge:
    """Merge state: the parser (for errors), ``args``, the explicit flags' dests, where each value
    came from (``sources``), the ``"auto"`` keys left without a value, and the grouped notes."""

    def __init__(self, parser, args, explicit: set[str], config: dict, path: str):
        self.parser, self.args, self.explicit, self.config, self.path = parser, args, explicit, config, path
        self.sources = {name: [] for name in SOURCE_ORDER}
        self.unresolved: list[str] = []
        self.notes = {"harmless": [], "no effect": [], "unknown, not read": []}

    def fail(self, message: str):
        self.parser.exit(2, f"{self.parser.prog}: error: --deepspeed-config {self.path}: {message}\n")

    def typed(self, key: str, value, kind):
        """Check a config value's type and range (``deepspeed_keys.RANGES``, always finite); numbers
        like ``1e9`` count as ints."""
        if kind in (bool, str):
            if not isinstance(value, kind):
                self.fail(f"key '{key}' must be {'true or false' if kind is bool else 'a string'}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"key '{key}' must be a number, got {value!r}")
        if kind is int:
            if not math.isfinite(value) or value != int(value):
                self.fail(f"key '{key}' must be an integer, got {value!r}")
        problem = range_error(key, value)
        if problem:
            self.fail(problem)
        return int(value) if kind is int else float(value)

    def record(self, source: str, key: str, value, dest: str | None = None) -> None:
        if source == "command line":
            self.sources[source].append(f"{flag_name(dest)}={value!r}")
        elif source == "auto":
            self.sources[source].append(f"{key}={value!r} ({flag_name(dest)})")
        else:
            self.sources[source].append(f"{key}={value!r}")

    def take(self, key: str, dest: str, block: dict, name: str, kind, default=None, convert=None):
        """Set flag ``dest`` from ``block[name]`` (full key ``key``): an explicit flag wins, then the
        config's value (``"auto"``: the flag's value), then ``default`` (None: keep the flag's).
        Returns the value used."""
        if dest in self.explicit:
            if name in block and block[name] != "auto":
                self.typed(key, block[name], kind)  # overridden, but still a valid value
            self.record("command line", key, getattr(self.args, dest), dest)
        elif name in block and block[name] == "auto":
            if getattr(self.args, dest) is None:
                self.unresolved.append(f"{key} ({flag_name(dest)})")
            else:
                self.record("auto", key, getattr(self.args, dest), dest)
        elif name in block or default is not None:
            value = self.typed(key, block[name], kind) if name in block else default
            self.record("config" if name in block else "DeepSpeed default", key, value)
            setattr(self.args, dest, convert(value) if convert else value)
        return getattr(self.args, dest)

    def block(self, key: str, value) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(f"key '{key}' must be an object")
        return value

    def note(self, key: str, value) -> bool:
        """File a key that megazero does not read under harmless / no effect; refuse one that would
        change training. False when the key is not in any table."""
        top = key.split(".")[0]
        if key in HARMLESS_KEYS:
            self.notes["harmless"].append(key)
        elif key in NO_EFFECT_KEYS or key in NO_EFFECT_SUBKEYS or (
                top == "zero_optimization" and key.split(".", 1)[1] in NO_EFFECT_ZERO_KEYS):
            self.notes["no effect"].append(key)
        elif key in ONLY_DEFAULT_KEYS:
            allowed = ONLY_DEFAULT_KEYS[key]
            setting = value
            if isinstance(value, dict):
                setting = value.get("enabled", key in BLOCKS_ENABLED_BY_PRESENCE)
            if setting != allowed and not (allowed is False and setting is None):
                self.fail(f"key '{key}' = {json.dumps(value)} changes training and is not available in megazero "
                          f"(only DeepSpeed's default {json.dumps(allowed)} is accepted)")
            self.notes["no effect"].append(key)
        else:
            return False
        return True

    def summary(self) -> str:
        parts = [f"{name}: {', '.join(items)}" for name, items in self.sources.items() if items]
        return f"--deepspeed-config {self.path}: " + "; ".join(parts)


def is_rank0(env=os.environ) -> bool:
    return current_rank(env) == 0


def data_parallel_size(args) -> int | None:
    mp = model_parallel_product(args)
    return args.world_size // mp if mp > 0 and args.world_size % mp == 0 else None


def apply_batch(m: Merge) -> None:
    """DeepSpeed's ``_set_batch_related_parameters`` and ``_batch_assertion`` with world size = DP."""
    args, config, dp = m.args, m.config, data_parallel_size(m.args)
    values = {}
    for key, dest in BATCH_KEYS.items():
        raw = config.get(key)
        if dest is not None and (dest in m.explicit or raw is None or raw == "auto"):
            values[key] = getattr(args, dest)
            if raw not in (None, "auto") and values[key] is not None and m.typed(key, raw, int) != values[key]:
                m.fail(f"key '{key}' = {raw!r} disagrees with {flag_name(dest)} {values[key]} (DeepSpeed would "
                       "train with the config's batch: its _batch_assertion refuses a batch that does not add "
                       'up); make them equal, write "auto", or drop one')
            source = "command line" if dest in m.explicit else "auto" if raw == "auto" else None
            if source and values[key] is not None:
                m.record(source, key, values[key], dest)
        else:
            values[key] = None if raw in (None, "auto") else m.typed(key, raw, int)
            if values[key] is not None:
                m.record("config", key, values[key])
    if dp is None:
        return  # validate() names the TP x PP / world-size mismatch
    train, micro, gas = values.values()
    if train is not None and micro is not None and gas is None:
        gas = train // micro // dp
    elif train is not None and gas is not None and micro is None:
        micro = train // dp // gas
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * dp
    elif train is not None and micro is None and gas is None:
        gas, micro = 1, train // dp
    elif micro is not None and train is None and gas is None:
        train, gas = micro * dp, 1
    elif train is None and micro is None:
        auto = [f"{k} ({flag_name(d)})" for k, d in BATCH_KEYS.items() if d and config.get(k) == "auto"]
        if auto:
            m.unresolved.extend(auto)
            return
        m.fail("either train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
               "(or --global-batch-size / --micro-batch-size)")
    for name, value in (("Train batch size", train), ("Micro batch size per gpu", micro),
                        ("Gradient accumulation steps", gas)):
        if value <= 0:
            m.fail(f"{name}: {value} has to be greater than 0")
    if train != micro * gas * dp:
        m.fail(f"Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
               f"gradient_acc_step * world_size {train} != {micro} * {gas} * {dp} (world_size = data-parallel "
               f"size = {args.world_size} ranks / (TP {args.tensor_model_parallel_size} x PP "
               f"{args.pipeline_model_parallel_size}))")
    args.micro_batch_size, args.global_batch_size = micro, train


def apply_precision(m: Merge, torch_adam: bool) -> None:
    """fp16 / bf16 blocks, clipping, and the loss-scaler defaults DeepSpeed would use."""
    args, config = m.args, m.config
    for key in ("bf16", "bfloat16", "fp16"):
        block = m.block(key, config.get(key))
        dest = "fp16" if key == "fp16" else "bf16"
        if "enabled" in block and dest not in m.explicit and block["enabled"] != "auto":
            if m.typed(f"{key}.enabled", block["enabled"], bool):
                setattr(args, dest, True)
                m.record("config", f"{key}.enabled", True)
        if block.get("enabled") == "auto":
            m.record("auto", f"{key}.enabled", getattr(args, dest), dest)
        for sub, value in block.items():
            full = f"{key}.{sub}"
            if sub != "enabled" and not (key == "fp16" and sub in FP16_KEYS) and not m.note(full, value):
                m.notes["unknown, not read"].append(full)
    fp16 = m.block("fp16", config.get("fp16"))
    for key, (dest, kind, default) in TOP_KEYS.items():
        m.take(key, dest, config, key, kind, default=default)
    if not args.fp16:
        return
    defaults, where = fp16_scaler_defaults(fp16, args.zero_stage, torch_adam)
    m.take("fp16.loss_scale", "loss_scale", fp16, "loss_scale", float, convert=lambda v: v or None)
    for name, (dest, kind) in FP16_KEYS.items():
        if name == "loss_scale":
            continue
        convert = (lambda p: 2.0 ** p) if name == "initial_scale_power" else None
        block = fp16
        if args.zero_stage == 0 and name == "hysteresis":
            block = {}  # FP16_Optimizer (stage 0) has no hysteresis: defaults[name] is 1
        m.take(f"fp16.{name}", dest, block, name, kind, default=defaults[name], convert=convert)
    m.sources["DeepSpeed default"].append(f"(loss scaler: {where})")


def apply_zero(m: Merge) -> None:
    """The zero_optimization block; unknown keys are errors (DeepSpeed's ZeRO config forbids them)."""
    zero = {}
    for name, value in m.block("zero_optimization", m.config.get("zero_optimization")).items():
        full = ZERO_ALIASES.get(name, name)  # 0.19.8 takes a field's name or its stage3_ alias
        if full in zero:
            m.fail(f"zero_optimization.{name} and zero_optimization.{full} are the same key; give one")
        zero[full] = value
    check_grad_norm(m, zero)
    for name, (dest, kind, default) in ZERO_KEYS.items():
        if name != "overlap_comm":
            m.take(f"zero_optimization.{name}", dest, zero, name, kind, default=default)
    m.take("zero_optimization.overlap_comm", "zero_overlap_comm", zero, "overlap_comm", bool,
           default=m.args.zero_stage == 3)  # DeepSpeed: None -> stage == 3
    for name, value in zero.items():
        key = f"zero_optimization.{name}"
        if name in ZERO_KEYS:
            continue
        if name in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param"):
            m.notes["no effect"].append(key)  # device "none"/false; anything else fails in check_offload
        elif not m.note(key, value):
            m.fail(f"key '{key}' is not a DeepSpeed ZeRO key (DeepSpeed's ZeRO config rejects unknown keys too)")


def planned_memory(args) -> str:
    """The planner's per-rank memory for this layout (``python -m megazero.planner``)."""
    from megazero.config.model import gpt_config
    from megazero.planner.memory import estimate
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size")
    missing = [flag_name(n) for n in need if getattr(args, n, None) is None]
    dp = data_parallel_size(args)
    if missing or dp is None:
        return f"give {', '.join(missing) or 'a valid layout'} to `python -m megazero.planner` for the per-rank memory"
    tp, pp, mbs = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size
    micro_batches = args.global_batch_size // (mbs * dp) if args.global_batch_size else 4 * pp
    per_vp = args.num_layers_per_virtual_pipeline_stage
    half, fp32_grads = args.fp16 or args.bf16, args.bf16 or args.accumulate_allreduce_grads_in_fp32
    layout = estimate(gpt_config(args), tp, pp, dp, args.zero_stage, micro_batch_size=mbs,
                              micro_batches=micro_batches, vp=args.num_layers // (pp * per_vp) if per_vp else 1,
                              param_bytes=2 if half else 4, grad_bytes=2 if half and not fp32_grads else 4,
                              sequence_parallel=args.sequence_parallel, recompute=args.recompute_granularity,
                              recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                              ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                              etp=getattr(args, "expert_tensor_parallel_size", None),
                              cp=getattr(args, "context_parallel_size", 1),
                              attention_scores=getattr(args, "attention_backend", "auto") in ("unfused", "local"))
    gib = 2.0 ** 30
    return (f"ZeRO stage {args.zero_stage} at DP {dp} (TP {tp}, PP {pp}) needs {layout.total_bytes / gib:.2f} GiB "
            f"per rank (model states {layout.model_state_bytes / gib:.2f} + activations "
            f"{layout.activation_bytes / gib:.2f}), see `python -m megazero.planner`")


def check_offload(m: Merge) -> None:
    found = offload_devices(m.block("zero_optimization", m.config.get("zero_optimization")))
    if found:
        kinds = {"parameter" if "param" in f else "optimizer" for f in found}
        what = " and ".join(sorted(kinds))
        m.fail(f"{', '.join(found)}: {what} offload is not available in megazero (every state stays on the GPU); "
               f"{planned_memory(m.args)}")


def note_other_keys(m: Merge) -> None:
    for key, value in m.config.items():
        if key in HANDLED:
            continue
        if key == "data_types" and isinstance(value, dict):
            for sub, sval in value.items():
                if not m.note(f"data_types.{sub}", sval):
                    m.notes["unknown, not read"].append(f"data_types.{sub}")
        elif not m.note(key, value):
            m.notes["unknown, not read"].append(key)


def apply_deepspeed_config(parser, args, explicit: set[str], env=os.environ, config: dict | None = None) -> str:
    """Merge ``args.deepspeed_config`` into ``args`` (see the module docstring); return the
    start-up line (printed on rank 0, with one warning grouping the keys megazero does not read).
    ``config``: the already-parsed JSON object (``megazero.initialize(config=dict)``); then
    ``args.deepspeed_config`` only names it in messages."""
    loaded = load_config(parser, args.deepspeed_config) if config is None else config
    m = Merge(parser, args, explicit, loaded, args.deepspeed_config)
    opt = apply_optimizer(m)
    apply_zero(m)
    apply_batch(m)
    apply_precision(m, torch_adam=opt["torch_adam"])
    apply_scheduler(m, opt)
    note_other_keys(m)
    if m.unresolved:
        m.fail('"auto" values with no command-line flag value to take: ' + ", ".join(m.unresolved)
               + "; give those flags or write the values")
    check_offload(m)
    line = m.summary()
    if is_rank0(env):
        print(line, flush=True)
        notes = "; ".join(f"{group}: {', '.join(keys)}" for group, keys in m.notes.items() if keys)
        if notes:
            warnings.warn(f"--deepspeed-config {m.path}: keys megazero does not read -- {notes}", stacklevel=3)
    return line
