"""``megazero.initialize``: DeepSpeed's entry point (deepspeed/__init__.py ``initialize``, 0.19.8)
over megazero's ZeRO, for any ``torch.nn.Module``.

Build order, once, with the reason for each step:

1. the process group: torchrun's (``env://``) when launched by it, else a one-process gloo group,
   so the same script runs alone and under torchrun;
2. the same model on every rank (one checksum all-gather; a differing rank is named);
3. the config, read by :mod:`megazero.config.deepspeed_config` (the ``--deepspeed-config`` code)
   with DP = world size: batch identity, optimizer, scheduler, precision, clipping, ZeRO knobs;
4. the module cast to fp16/bf16 when the config enables it (DeepSpeed casts the module too) and
   moved to this rank's GPU under NCCL;
5. the ZeRO optimizer over the whole module as one chunk: stage 3 units are ``zero_units``
   (modules or their names) or, by default, every child of an ``nn.ModuleList``/``ModuleDict``
   (a transformer layer), else blocks chosen by size (:mod:`.units`), the rest in one root unit; parameters registered in two modules (tied
   embeddings) or smaller than ``stage3_param_persistence_threshold`` stay whole
   (:mod:`megazero.zero.regions`);
6. the param groups as the user passed them (``model_parameters``: parameters or dicts with
   ``params`` and per-group settings; or a client ``torch.optim.Adam/AdamW``'s groups, the very
   dicts, so a scheduler built on that optimizer still drives them), the config's optimizer
   settings as the defaults;
7. the LR scheduler: the config's ``scheduler`` block, else ``lr_scheduler`` (an object with
   ``step()``, or a callable taking the optimizer, as DeepSpeed accepts).

A model too large for one rank is built on the meta device (``with torch.device("meta"):``; its
buffers on a real device) and given ``param_init(name, param) -> tensor``: each ZeRO region
materializes its own parameters from it, so at stage 3 a rank holds at most one unit's full
parameters while building (``engine.zero.build_peak_unit_bytes``), the role of DeepSpeed's
``zero.Init``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from megazero.config.engine_config import config_source, read_engine_config
from megazero.parallel.topology import Topology
from megazero.zero import ZeroOptimizer

from .checks import check_registered, check_same_model, slow_knobs
from .engine import ZeroEngine
from .optimizer import EngineOptimizer
from megazero.optim.group_schedule import GroupLRScheduler
from .muon import muon_setup
from .units import default_units


def _process_group() -> None:
    """torchrun's group (env://) if launched by it, else a world of one over gloo."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _client_settings(optimizer) -> dict | None:
    if optimizer is None:
        return None
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"megazero.initialize: optimizer {type(optimizer).__name__} is not available; pass a "
                         "torch.optim.Adam/AdamW or an 'optimizer' block (Adam/AdamW) in the config")
    g = optimizer.param_groups[0]
    for flag in ("amsgrad", "maximize"):
        if any(group.get(flag) for group in optimizer.param_groups):
            raise ValueError(f"megazero.initialize: optimizer {flag}=True is not available in megazero")
    return {"lr": float(g["lr"]), "betas": tuple(g["betas"]), "eps": float(g["eps"]),
            "weight_decay": float(g["weight_decay"]), "adam_w_mode": isinstance(optimizer, torch.optim.AdamW)}


def _param_groups(module: nn.Module, model_parameters, client) -> list[dict]:
    """The user's groups (dicts with ``params``), trainable parameters only, each checked to
    belong to ``module``."""
    if client is not None:
        groups = client.param_groups
    elif model_parameters is None:
        groups = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    else:
        given = list(model_parameters)
        groups = [dict(g) for g in given] if given and isinstance(given[0], dict) else [{"params": given}]
    for g in groups:
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        check_registered(module, g["params"])
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def _units(module: nn.Module, zero_units):
    """``zero_units`` as modules (names resolved with ``get_submodule``), or the default
    (:func:`~.units.default_units`)."""
    if zero_units is None:
        return default_units(module)
    out = []
    for u in zero_units:
        if isinstance(u, str):
            try:
                u = module.get_submodule(u)
            except AttributeError:
                raise ValueError(f"megazero.initialize: zero_units names {u!r}, not a submodule of the model") from None
        if not isinstance(u, nn.Module):
            raise ValueError(f"megazero.initialize: zero_units holds a {type(u).__name__}, not a module")
        out.append(u)
    return [out]


def _prepare(module: nn.Module, cfg, param_init):
    """Cast and place the module; for a meta-device model, check it and return ``(the regions'
    param_init, the device)``, else ``(None, None)``."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else None
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if not meta:
        module.to(dtype=cfg.params_dtype if cfg.params_dtype != torch.float32 else None, device=device)
        return None, None
    if param_init is None:
        raise ValueError(f"megazero.initialize: parameter {meta[0]!r} is on the meta device; pass "
                         "param_init=(name, param) -> tensor to materialize it")
    bad = next((n for n, b in module.named_buffers() if b.is_meta), None)
    if bad is not None:
        raise ValueError(f"megazero.initialize: buffer {bad!r} is on the meta device; build buffers on a real device")
    frozen = next((n for n, p in module.named_parameters() if p.is_meta and not p.requires_grad), None)
    if frozen is not None:
        raise ValueError(f"megazero.initialize: frozen parameter {frozen!r} is on the meta device (only trainable "
                         "parameters are materialized by ZeRO)")
    module.to(dtype=cfg.params_dtype if cfg.params_dtype != torch.float32 else None)
    if device is not None:
        for b in module.buffers():
            b.data = b.data.to(device)
    name_of = {id(p): n for n, p in module.named_parameters()}
    return (lambda p: param_init(name_of[id(p)], p)), device or torch.device("cpu")


def _zero(module, topo, cfg, units, materialize) -> ZeroOptimizer:
    return ZeroOptimizer(
        module, topo, stage=cfg.stage, num_micro_batches=cfg.gradient_accumulation_steps, lr=cfg.lr,
        weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps, clip_grad=cfg.gradient_clipping,
        decoupled_weight_decay=cfg.adam_w_mode, params_dtype=cfg.params_dtype, loss_scale=cfg.loss_scale,
        initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
        reduce_bucket_size=cfg.reduce_bucket_size, overlap_comm=cfg.overlap_comm,
        prefetch_bucket_size=cfg.prefetch_bucket_size, param_persistence_threshold=cfg.param_persistence_threshold,
        max_live_parameters=cfg.max_live_parameters, max_reuse_distance=cfg.max_reuse_distance, units=units,
        param_init=materialize[0], device=materialize[1], scaler_rule="deepspeed")


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None, zero_units=None,
               param_init=None, **unsupported):
    """Wrap ``model`` for ZeRO data-parallel training; returns ``(engine, optimizer, None,
    lr_scheduler)`` as ``deepspeed.initialize`` does (see the module docstring), with its
    signature (deepspeed/__init__.py 0.19.8; ``distributed_port`` is not used: the process group
    comes from torchrun's environment). ``optimizer`` may be a callable of the parameters. ``config`` (or
    DeepSpeed's alias ``config_params``): a ds_config path or dict. ``zero_units``: stage-3 unit
    modules (or names). ``param_init``: values of a meta-device model's parameters (module
    docstring). ``args`` is accepted for DeepSpeed's signature and must not carry a
    config (pass ``config=``)."""
    if unsupported:
        raise ValueError(f"megazero.initialize: unsupported argument(s) {', '.join(sorted(unsupported))}")
    if not isinstance(model, nn.Module):
        raise ValueError("megazero.initialize: model= must be a torch.nn.Module")
    if training_data is not None or collate_fn is not None:
        raise ValueError("megazero.initialize: training_data is not available; build your DataLoader with a "
                         "DistributedSampler (rank = dist.get_rank()) and pass none here")
    if mpu is not None or mesh_param is not None:
        raise ValueError("megazero.initialize: mpu / mesh_param (model parallelism of the user's module) are not "
                         "available; the engine is data-parallel (ZeRO) over all ranks")
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError("megazero.initialize: dist_init_required=False but torch.distributed is not initialized")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    config = config_source(config, config_params, args)
    _process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_same_model(model)
    client = _client_settings(optimizer)
    cfg = read_engine_config(config, world, rank, client)
    if cfg.scheduler is not None and lr_scheduler is not None:
        raise ValueError("megazero.initialize: lr_scheduler was passed and the config has a 'scheduler' block; "
                         "give one of them")
    groups = _param_groups(model, model_parameters, optimizer)
    materialize = _prepare(model, cfg, param_init)
    topo = Topology(world, rank).create_groups()
    zero = _zero(model, topo, cfg, _units(model, zero_units), materialize)
    if cfg.muon is not None:  # DeepSpeed's Muon halves (engine/muon.py)
        groups, settings, matrices = muon_setup(model, groups, cfg.muon)
        zero.set_muon(settings, matrices)
    defaults = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    opt = EngineOptimizer(zero, groups, defaults)
    if cfg.scheduler is not None:
        sched = GroupLRScheduler(opt, cfg.scheduler)
    elif lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        sched = lr_scheduler(opt)
    else:
        sched = lr_scheduler
    line = slow_knobs(cfg.stage, cfg.reduce_bucket_size, cfg.prefetch_bucket_size, cfg.max_live_parameters,
                      [p for g in groups for p in g["params"]],
                      [u.region.numel for u in zero.gatherer.units] if zero.gatherer is not None else [])
    if line and rank == 0:
        print(line, flush=True)
    return ZeroEngine(model, opt, zero, sched, cfg, topo), opt, None, sched
