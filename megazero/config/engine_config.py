"""The DeepSpeed config of ``megazero.initialize``, read by the same code as ``--deepspeed-config``.

:func:`read_engine_config` builds megazero's flag parser with no flags given, merges the config
through :func:`megazero.config.deepspeed_config.apply_deepspeed_config` (so every key is honoured,
filed as no-effect, or refused exactly as for ``pretrain_gpt.py --deepspeed-config``) and returns
the typed :class:`EngineConfig`. The world size given is the data-parallel size (the engine has no
TP/PP), so DeepSpeed's batch identity ``train_batch_size = micro * gradient_accumulation_steps *
DP`` is checked with DeepSpeed's message. A bad config raises ``ValueError`` with the one line the
flag parser would have printed.

Without an ``optimizer`` block the caller's optimizer settings (``client``: the ``lr``, ``betas``,
``eps``, ``weight_decay`` of a ``torch.optim.Adam/AdamW`` handed to ``initialize``) take the place
of Megatron's flags, as DeepSpeed uses a client optimizer; with neither there is no optimizer and
the call is refused (DeepSpeed would build an engine that cannot step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from dataclasses import dataclass, field

import torch

from megazero.config.deepspeed_config import apply_deepspeed_config
from megazero.config.deepspeed_muon import check_muon_config
from megazero.config.flags import build_parser


@dataclass(frozen=True)
class EngineConfig:
    """What the engine reads from a DeepSpeed config (DeepSpeed's names in the comments)."""

    stage: int                       # zero_optimization.stage
    micro_batch_size: int            # train_micro_batch_size_per_gpu
    train_batch_size: int            # train_batch_size
    gradient_accumulation_steps: int
    lr: float                        # optimizer.params.lr
    betas: tuple
    eps: float
    weight_decay: float
    adam_w_mode: bool                # decoupled weight decay (AdamW) or L2 (Adam, adam_w_mode false)
    gradient_clipping: float
    params_dtype: torch.dtype        # fp16 / bf16 .enabled, else fp32
    loss_scale: float | None         # fp16: None = dynamic
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int
    reduce_bucket_size: int
    overlap_comm: bool
    prefetch_bucket_size: int        # stage3_prefetch_bucket_size
    param_persistence_threshold: int  # stage3_param_persistence_threshold
    max_live_parameters: int         # stage3_max_live_parameters
    max_reuse_distance: int          # stage3_max_reuse_distance
    optimizer_in_config: bool
    scheduler: dict | None = None    # DeepSpeedLRScheduler keywords, None: no scheduler block
    muon: dict | None = None         # optimizer.type Muon: {"settings": MuonSettings fields, "halves": ...}
    summary: str = ""
    raw: dict = field(default_factory=dict, repr=False)


def _load(config) -> tuple[dict, str]:
    """(the JSON object, its name in messages) of a path or a dict."""
    if isinstance(config, dict):
        return config, "config"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ValueError(f"megazero.initialize: config file not found: {path}")
        try:
            with open(path) as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"megazero.initialize: {path} is not valid JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"megazero.initialize: {path} must hold a JSON object")
        return loaded, path
    raise ValueError(f"megazero.initialize: config must be a path or a dict, got {type(config).__name__}")


def config_source(config, config_params, args):
    """The ds_config ``initialize`` was given: ``config``, DeepSpeed's alias ``config_params``,
    or an argparse namespace's ``deepspeed_config`` (DeepSpeed's ``args``), in that order."""
    for given in (config, config_params, getattr(args, "deepspeed_config", None)):
        if given is not None:
            return given
    raise ValueError("megazero.initialize: config= (a ds_config path or dict) is required")


def read_engine_config(config, dp_size: int, rank: int = 0, client: dict | None = None) -> EngineConfig:
    """The :class:`EngineConfig` of ``config`` (path or dict) at data-parallel size ``dp_size``
    (see the module docstring); ``client``: a client optimizer's first param group's settings."""
    loaded, name = _load(config)
    if client is not None and "optimizer" in loaded:
        raise ValueError("megazero.initialize: an optimizer was passed and the config has an 'optimizer' block; "
                         "give one of them (DeepSpeed refuses both too)")
    parser = build_parser("megazero.initialize", every_rank=True)  # the message is raised, not printed
    args = parser.parse_args([], namespace=argparse.Namespace())
    args.world_size, args.deepspeed_config = dp_size, name
    explicit = set()
    if client is not None:
        args.lr, args.adam_eps, args.weight_decay = client["lr"], client["eps"], client["weight_decay"]
        args.adam_beta1, args.adam_beta2 = client["betas"]
        args.adam_w_mode = client["adam_w_mode"]
    elif "optimizer" not in loaded:
        raise ValueError(f"megazero.initialize: {name} has no 'optimizer' block and no optimizer was passed; "
                         "add {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": ...}}} or pass optimizer=")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            summary = apply_deepspeed_config(parser, args, explicit, env={"RANK": str(rank)}, config=loaded)
    except SystemExit:
        line = err.getvalue().strip().splitlines()
        raise ValueError(line[-1] if line else f"megazero.initialize: invalid config {name}") from None
    return _typed(args, loaded, dp_size, summary)


def _typed(args, loaded: dict, dp_size: int, summary: str) -> EngineConfig:
    gas = args.global_batch_size // (args.micro_batch_size * dp_size)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    return EngineConfig(
        stage=args.zero_stage, micro_batch_size=args.micro_batch_size, train_batch_size=args.global_batch_size,
        gradient_accumulation_steps=gas, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        weight_decay=args.weight_decay, adam_w_mode=getattr(args, "adam_w_mode", True),
        gradient_clipping=args.clip_grad, params_dtype=dtype, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        reduce_bucket_size=args.zero_reduce_bucket_size, overlap_comm=args.zero_overlap_comm,
        prefetch_bucket_size=args.zero_prefetch_bucket_size,
        param_persistence_threshold=args.zero_param_persistence_threshold,
        max_live_parameters=args.zero_max_live_parameters, max_reuse_distance=args.zero_max_reuse_distance,
        optimizer_in_config="optimizer" in loaded, scheduler=args.deepspeed_scheduler, summary=summary, raw=loaded,
        muon=_muon(args))


def _muon(args) -> dict | None:
    """A Muon block's settings and halves (config/deepspeed_muon.py), its refusals raised."""
    if getattr(args, "muon_halves", None) is None:
        return None
    problems = []
    check_muon_config(problems.append, args)
    if problems:
        raise ValueError(f"megazero.initialize: {problems[0]}")
    return {"settings": dict(args.muon_settings), "halves": args.muon_halves}
