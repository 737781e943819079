"""``engine.save_checkpoint(dir, tag, format="deepspeed")``: DeepSpeed 0.19.8's files, so that
DeepSpeed's ``zero_to_fp32`` recovers the fp32 weights and ``deepspeed.initialize(...)
.load_checkpoint(dir)`` continues at the same DP size and ZeRO stage (1, 2 or 3).

The layout and keys are those :mod:`megazero.checkpoint.deepspeed_files` reads (its docstring
cites DeepSpeed's code). DeepSpeed's own partitioning is reproduced:

* ZeRO 1/2 (runtime/zero/stage_1_and_2.py 0.19.8, ``flatten_dense_tensors_aligned`` with
  ``nccl_start_alignment_factor * dp`` = ``2 * dp``): each optimizer group's parameters in the
  group's order, one flat vector padded to a multiple of ``2 * dp``, ``P = padded / dp``; rank ``r``
  writes elements ``[r * P, (r + 1) * P)`` cut at the unpadded end (``_get_groups_without_padding``),
  its moments over the whole ``P`` (zeros in the padding), as torch AdamW's rigid state dict.
* ZeRO 3 (runtime/zero/stage3.py): every parameter's ``ceil(n / dp)``-element piece ``r``.
* A bf16 engine's optim-states files are named ``bf16_zero_pp_rank_*`` (engine.py
  ``_get_zero_ckpt_prefix``, ``bf16_mode = self.bfloat16_enabled()``).

What DeepSpeed's loaders need beyond the tensors: stage 3's ``_rigid_load_state_dict`` assigns
``loss_scaler`` (a ``deepspeed.runtime.fp16.loss_scaler.LossScaler``) and reads
``dynamic_loss_scale`` / ``overflow``; stage 1/2 keep their own scaler when ``loss_scaler`` is
absent (``_load_global_state``). DeepSpeed's classes are written under their names by a pickler
that maps :data:`megazero.checkpoint.deepspeed_files.SAFE`'s stand-ins back (no DeepSpeed import).
Only an fp32 (static scale 1) engine's scaler is written faithfully; an fp16 dynamic scale is
written as a static one (refused below instead of silently changed).

Saving first writes megazero's own engine files into ``{dir}/{tag}.megazero-scratch`` (the
crash-safe save of :mod:`megazero.checkpoint.engine`), reads each rank's DeepSpeed partition from
them by element ranges, writes DeepSpeed's files into ``{tag}.tmp`` (``.partial`` names), agrees
on the writes, publishes ``{tag}`` and ``latest``, and removes the scratch folder.
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


def _scaler():
    s = ds.LossScalerRecord()
    s.cur_scale, s.dynamic = 1.0, False
    return s


def _lr_state(engine):
    if engine.lr_scheduler is None:
        return None
    sd = engine.lr_scheduler.state_dict()
    return {"last_batch_iteration": int(sd["num_steps"]) - 1} if "num_steps" in sd else sd


def _model_states(engine, groups, aliases, module_sd, client_state) -> dict:
    shapes = [OrderedDict((n, torch.Size(p.shape)) for n, p in g) for g in groups]
    out = dict(module=module_sd, buffer_names=list(engine_files.persistent_buffers(engine.module)), optimizer=None,
               param_shapes=shapes, frozen_param_shapes=None, shared_params=dict(aliases),
               frozen_param_fragments=None, lr_scheduler=_lr_state(engine), data_sampler=None, random_ltd=None,
               skipped_steps=engine.skipped_steps, global_steps=engine.global_steps,
               global_samples=engine.global_samples, dp_world_size=engine.topo.dp, mp_world_size=1,
               checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
               ds_config=dict(getattr(engine.config, "raw", {}) or {}), ds_version=DS_VERSION)
    out.update(client_state or {})
    return out


def _ranges(group, world: int, rank: int, stage3: bool):
    """``[(name, a, b)]``: the elements of each parameter rank ``rank``'s DeepSpeed partition of
    the group holds, in its order, and the partition's padded length."""
    if stage3:
        out = []
        for name, p in group:
            n = p.numel()
            q = math.ceil(n / world)
            out.append((name, min(rank * q, n), min((rank + 1) * q, n), q))
        return out, sum(q for *_, q in out)
    total = sum(p.numel() for _, p in group)
    part = math.ceil(total / (2 * world)) * 2
    lo, hi, out, o = rank * part, (rank + 1) * part, [], 0
    for name, p in group:
        a, b = max(o, lo), min(o + p.numel(), hi)
        if a < b:
            out.append((name, a - o, b - o, b - a))
        o += p.numel()
    return out, part


def _partition(saved, group, world, rank, stage3):
    """This rank's ``master``, ``exp_avg``, ``exp_avg_sq`` partition of one group (padded length)
    and the master's unpadded length."""
    ranges, length = _ranges(group, world, rank, stage3)
    out = {k: torch.zeros(length) for k in engine_files.KINDS}
    pos = 0
    for name, a, b, width in ranges:
        for k in engine_files.KINDS:
            out[k][pos:pos + b - a] = saved.read(name, k, a, b)
        pos += width
    return out, (length if stage3 else pos)


def _optim_states(engine, saved, groups, rank, stage3) -> dict:
    world, hp = engine.topo.dp, engine.optimizer.hparams()
    parts = [_partition(saved, g, world, rank, stage3) for g in groups]
    step = torch.tensor(float(engine.zero.iteration))
    state = {g: {"step": step.clone(), "exp_avg": p["exp_avg"], "exp_avg_sq": p["exp_avg_sq"]}
             for g, (p, _) in enumerate(parts)}
    param_groups = [{"lr": h["lr"], "betas": tuple(h["betas"]), "eps": h["eps"], "weight_decay": h["weight_decay"],
                     "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True, "params": [g]}
                    for g, h in enumerate(hp)]
    base = {"state": state, "param_groups": param_groups}
    common = {"loss_scaler": _scaler(), "dynamic_loss_scale": False, "overflow": False,
              "zero_stage": ds.StageNumber(engine.config.stage), "ds_version": DS_VERSION}
    if stage3:
        osd = dict(common, partition_count=world, optimizer_state_dict=base,
                   fp32_flat_groups=[p["master"] for p, _ in parts])
    else:
        osd = dict(common, clip_grad=float(engine.config.gradient_clipping or 0.0), base_optimizer_state=base,
                   single_partition_of_fp32_groups=[p["master"][:n].clone() for p, n in parts],
                   group_paddings=[p["master"].numel() - n for p, n in parts],
                   param_alignment_paddings=[[0] * len(g) for g in groups], partition_count=[world] * len(groups))
    return {"optimizer_state_dict": osd, "ds_config": dict(getattr(engine.config, "raw", {}) or {}),
            "ds_version": DS_VERSION}


def _groups(engine, name_of):
    return [[(name_of[id(p)], p) for p in g["params"]] for g in engine.optimizer.param_groups]


def save(engine, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Write DeepSpeed's files for ``tag`` (collective; module doc). Returns the folder."""
    stage, rank = engine.config.stage, engine.topo.rank
    if stage not in (1, 2, 3):
        raise ValueError(f"engine.save_checkpoint(format='deepspeed'): ZeRO stage {stage} has no DeepSpeed ZeRO "
                         "files (stages 1, 2, 3 only)")
    if engine.zero.scaler.state_dict().get("scale", 1.0) != 1.0:
        raise ValueError("engine.save_checkpoint(format='deepspeed'): an fp16 loss scale is not written in "
                         "DeepSpeed's layout (fp32 and bf16 only)")
    stage3, final = stage == 3, os.path.join(save_dir, str(tag))
    scratch, tmp = final + ".megazero-scratch", final + ".tmp"
    name_of, aliases = engine_files.names(engine.module)
    module_sd = engine.module_state_dict()  # collective at stage 3
    engine_files.save(engine, scratch, "shards")
    saved = engine_files.SavedShards(*engine_files.resolve(scratch, "shards"))
    groups = _groups(engine, name_of)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if stage3:
        params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
        empty = {k: torch.empty(0, dtype=v.dtype) if k in params else v for k, v in module_sd.items()}
        error = _write(_model_states(engine, groups, aliases, empty, client_state),
                       os.path.join(tmp, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), tmp)
    else:
        error = None if rank else _write(_model_states(engine, groups, aliases, module_sd, client_state),
                                         os.path.join(tmp, ds.MODEL_12), tmp)
    prefix = "bf16_" if engine.config.params_dtype == torch.bfloat16 else ""  # engine.py _get_zero_ckpt_prefix
    error = error or _write(_optim_states(engine, saved, groups, rank, stage3),
                            os.path.join(tmp, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"), tmp)
    try:  # every rank has read the scratch folder once the writes are agreed on (or failed)
        agree_on_writes(error, rank, tmp, f"engine.save_checkpoint {final}",
                        f"{os.path.join(save_dir, 'latest')} and any earlier {final} are as they were")
        if rank == 0:
            replace_folder(tmp, final)
            atomic_write_text(os.path.join(save_dir, "latest"), str(tag))
    finally:
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    return final
