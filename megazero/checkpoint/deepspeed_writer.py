"""``engine.save_checkpoint(dir, tag, format="deepspeed")``: DeepSpeed 0.19.8's files, so that
DeepSpeed's ``zero_to_fp32`` recovers the fp32 weights and ``deepspeed.initialize(...)
.load_checkpoint(dir)`` continues at the same DP size and ZeRO stage (1, 2 or 3).

The layout and keys are those :mod:`megazero.checkpoint.deepspeed_files` reads (its docstring
cites DeepSpeed's code); each rank's partition in DeepSpeed's layout is built from the engine's
ZeRO shards by an ``all_to_all`` per region (:mod:`megazero.checkpoint.deepspeed_partitions`)
and written straight into DeepSpeed's files: no other copy is written. A bf16 engine's
optim-states files are named ``bf16_zero_pp_rank_*`` (engine.py ``_get_zero_ckpt_prefix``,
``bf16_mode = self.bfloat16_enabled()``).

What DeepSpeed's loaders need beyond the tensors: stage 3's ``_rigid_load_state_dict`` and stage
1/2's ``_load_global_state`` take the pickled ``loss_scaler`` object as the engine's scaler, with
``dynamic_loss_scale`` and ``overflow``. A constant scale (fp32, bf16: 1; fp16 ``loss_scale``
> 0) is a ``LossScaler``; the fp16 dynamic scale a ``DynamicLossScaler`` carrying the engine's
state (:func:`loss_scaler_record`). DeepSpeed's classes are written under their names by a
pickler that maps :data:`megazero.checkpoint.deepspeed_files.SAFE`'s stand-ins back (no
DeepSpeed import).

Frozen parameters (``requires_grad`` False, in no optimizer group) are written as DeepSpeed
writes them (engine.py ``_common_checkpoint_state``, ``save_frozen_param`` at stages 2 and 3):
``frozen_param_shapes`` and ``frozen_param_fragments`` (the whole tensor at stage 2; rank ``r``'s
``ceil(n / W)``-element piece, zero-padded, at stage 3); at stage 1 they are in ``module`` only.

Crash-safe as the engine's own format: ``{tag}.tmp`` (``.partial`` names), every rank's write
agreed, then ``{tag}`` and ``latest`` published.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import types
from collections import OrderedDict

import torch
import torch.distributed as dist

from megazero.checkpoint import deepspeed_files as ds
from megazero.checkpoint import engine as engine_files
from megazero.checkpoint.deepspeed_partitions import partitions
from megazero.checkpoint.files import agree_on_writes, atomic_write_text, replace_folder, write_file

DS_VERSION = "0.19.8"
_NAMES = {cls: name for cls, name in ds.SAFE}


class _Pickler(pickle._Pickler):
    """Protocol-2 pickler writing :data:`_NAMES`' stand-ins under DeepSpeed's global names."""

    def save_global(self, obj, name=None):
        target = _NAMES.get(obj)
        if target is None:
            return super().save_global(obj, name)
        module, _, qual = target.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qual}\n".encode())
        self.memoize(obj)


PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="megazero_deepspeed_pickle")


def _write(obj, path: str, tmp: str):
    """``write_file`` (crash-safe ``.partial`` name) with :data:`PICKLE`; an error or None."""
    return write_file(obj, path, tmp, pickle_module=PICKLE)


def loss_scaler_record(scaler, steps: int):
    """DeepSpeed's pickled scaler for the engine's (deepspeed/runtime/fp16/loss_scaler.py 0.19.8).

    A constant scale: ``LossScaler`` (``cur_scale``, ``dynamic`` False). The dynamic one (the
    engine follows DeepSpeed's rule, :class:`megazero.zero.loss_scaler.DeepSpeedLossScaler`):
    ``DynamicLossScaler`` with the engine's own ``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, window, minimum and hysteresis
    (``delayed_shift``), copied. ``steps`` is unused (kept for the callers).
    :func:`megazero.checkpoint.deepspeed_files.scaler_state` copies them back."""
    sd = scaler.state_dict()
    if "cur_iter" not in sd:
        s = ds.LossScalerRecord()
        s.cur_scale, s.dynamic = float(sd["scale"]), False
        return s
    s = ds.DynamicLossScalerRecord()
    s.cur_scale, s.dynamic, s.cur_iter = float(sd["scale"]), True, int(sd["cur_iter"])
    s.last_overflow_iter, s.cur_hysteresis = int(sd["last_overflow_iter"]), int(sd["cur_hysteresis"])
    s.scale_factor, s.scale_window, s.min_scale = float(scaler.growth), int(scaler.window), float(scaler.min_scale)
    s.delayed_shift, s.consecutive_hysteresis = int(scaler.hysteresis), bool(scaler.consecutive_hysteresis)
    s.raise_error_at_min_scale, s.dtype = bool(scaler.raise_at_min), torch.float16
    return s


def _lr_state(engine):
    if engine.lr_scheduler is None:
        return None
    sd = engine.lr_scheduler.state_dict()
    return {"last_batch_iteration": int(sd["num_steps"]) - 1} if "num_steps" in sd else sd


def _frozen(engine, name_of, stage: int, rank: int):
    """DeepSpeed's ``frozen_param_shapes`` and ``frozen_param_fragments`` (module doc), or Nones."""
    if stage < 2:
        return None, None
    shapes, pieces, world = OrderedDict(), OrderedDict(), engine.topo.dp
    for p in engine.module.parameters():
        if p.requires_grad:
            continue
        name, flat = name_of[id(p)], p.detach().reshape(-1).cpu()
        shapes[name] = torch.Size(p.shape)
        if stage == 3:
            q = math.ceil(flat.numel() / world)
            flat = torch.cat([flat, flat.new_zeros(q * world - flat.numel())])[rank * q:(rank + 1) * q]
        pieces[name] = flat.clone() if stage == 3 else flat.clone().view(p.shape)
    return shapes, pieces


def _model_states(engine, groups, aliases, module_sd, client_state, frozen) -> dict:
    shapes = [OrderedDict((n, torch.Size(p.shape)) for n, p in g) for g in groups]
    out = dict(module=module_sd, buffer_names=list(engine_files.persistent_buffers(engine.module)), optimizer=None,
               param_shapes=shapes, frozen_param_shapes=frozen[0], shared_params=dict(aliases),
               frozen_param_fragments=frozen[1], lr_scheduler=_lr_state(engine), data_sampler=None, random_ltd=None,
               skipped_steps=engine.skipped_steps, global_steps=engine.global_steps,
               global_samples=engine.global_samples, dp_world_size=engine.topo.dp, mp_world_size=1,
               checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
               ds_config=dict(getattr(engine.config, "raw", {}) or {}), ds_version=DS_VERSION)
    out.update(client_state or {})
    return out


def _groups_sizes(engine) -> list:
    return [g["params"] for g in engine.optimizer.param_groups]


def _optim_states(engine, parts, stage3) -> dict:
    """One rank's optim-states dict from its partitions (:func:`partitions`)."""
    world, hp = engine.topo.dp, engine.optimizer.hparams()
    step = torch.tensor(float(engine.zero.iteration))
    state = {g: {"step": step.clone(), "exp_avg": p["exp_avg"], "exp_avg_sq": p["exp_avg_sq"]}
             for g, (p, _) in enumerate(parts)}
    param_groups = [{"lr": h["lr"], "betas": tuple(h["betas"]), "eps": h["eps"], "weight_decay": h["weight_decay"],
                     "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True, "params": [g]}
                    for g, h in enumerate(hp)]
    scaler = loss_scaler_record(engine.zero.scaler, engine.global_steps)
    common = {"loss_scaler": scaler, "dynamic_loss_scale": bool(scaler.dynamic), "overflow": False,
              "zero_stage": ds.StageNumber(engine.config.stage), "ds_version": DS_VERSION}
    base = {"state": state, "param_groups": param_groups}
    if stage3:
        osd = dict(common, partition_count=world, optimizer_state_dict=base,
                   fp32_flat_groups=[p["master"] for p, _ in parts])
    else:
        osd = dict(common, clip_grad=float(engine.config.gradient_clipping or 0.0), base_optimizer_state=base,
                   single_partition_of_fp32_groups=[p["master"][:n].clone() for p, n in parts],
                   group_paddings=[p["master"].numel() - n for p, n in parts],
                   param_alignment_paddings=[[0] * len(g) for g in _groups_sizes(engine)],
                   partition_count=[world] * len(parts))
    return {"optimizer_state_dict": osd, "ds_config": dict(getattr(engine.config, "raw", {}) or {}),
            "ds_version": DS_VERSION}


def _groups(engine, name_of):
    return [[(name_of[id(p)], p) for p in g["params"]] for g in engine.optimizer.param_groups]


def save(engine, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Write DeepSpeed's files for ``tag`` (collective; module doc). Returns the folder."""
    stage, rank = engine.config.stage, engine.topo.rank
    if stage not in (1, 2, 3):
        raise ValueError(f"engine.save_checkpoint(format='deepspeed'): ZeRO stage {stage} has no DeepSpeed ZeRO "
                         "files (stages 1, 2, 3 only; the engine's own format saves stage 0)")
    stage3, final = stage == 3, os.path.join(save_dir, str(tag))
    tmp = final + ".tmp"
    engine.zero.wait_params()
    name_of, aliases = engine_files.names(engine.module)
    groups = _groups(engine, name_of)
    parts = partitions(engine.zero, name_of, groups, engine.topo.dp, rank, stage3)
    frozen = _frozen(engine, name_of, stage, rank)
    if stage3:  # DeepSpeed's stage-3 module entry: the parameters empty, the buffers whole (nothing gathered:
        # the module's own state_dict() would gather every unit)
        module_sd = {n: torch.empty(0, dtype=p.dtype) for n, p in engine.module.named_parameters(remove_duplicate=False)}
        module_sd.update(engine_files.persistent_buffers(engine.module))
    else:
        module_sd = engine.module_state_dict()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if stage3:
        error = _write(_model_states(engine, groups, aliases, module_sd, client_state, frozen),
                       os.path.join(tmp, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), tmp)
    else:
        error = None if rank else _write(_model_states(engine, groups, aliases, module_sd, client_state, frozen),
                                         os.path.join(tmp, ds.MODEL_12), tmp)
    prefix = "bf16_" if engine.config.params_dtype == torch.bfloat16 else ""  # engine.py _get_zero_ckpt_prefix
    error = error or _write(_optim_states(engine, parts, stage3),
                            os.path.join(tmp, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"), tmp)
    agree_on_writes(error, rank, tmp, f"engine.save_checkpoint {final}",
                    f"{os.path.join(save_dir, 'latest')} and any earlier {final} are as they were")
    if rank == 0:
        replace_folder(tmp, final)
        atomic_write_text(os.path.join(save_dir, "latest"), str(tag))
    dist.barrier()
    return final
