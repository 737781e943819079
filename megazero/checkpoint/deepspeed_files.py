"""DeepSpeed's checkpoint files read into ``megazero.initialize``'s engine (DeepSpeed 0.19.8,
ZeRO 1, 2 or 3, any saved DP size, loaded at any DP size and ZeRO stage).

DeepSpeed's layout of ``{dir}/{tag}/`` (``{dir}/latest`` holds the tag), as written by
deepspeed/runtime/engine.py 0.19.8 (``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``,
``_save_checkpoint``, ``_save_zero_checkpoint``)::

    mp_rank_00_model_states.pt                      ZeRO 1/2: the module's full state_dict
    zero_pp_rank_{r}_mp_rank_00_model_states.pt     ZeRO 3: one per DP rank (parameters empty)
    {bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt   one per DP rank r

A model-states file holds ``module``, ``buffer_names``, ``param_shapes`` (one ordered
``{name: shape}`` per optimizer group, tied duplicates left out and named in ``shared_params``),
``global_steps``, ``skipped_steps``, ``global_samples``, ``dp_world_size``, ``mp_world_size``,
``lr_scheduler`` and the caller's ``client_state`` keys at top level. An optim-states file holds
``optimizer_state_dict`` (``zero_stage``, ``partition_count``, ``loss_scaler``):

* ZeRO 1/2 (runtime/zero/stage_1_and_2.py ``state_dict``): ``single_partition_of_fp32_groups[g]``
  is elements ``[r * P, (r + 1) * P)`` of group ``g``'s flat fp32 vector (``P`` rank 0's length;
  the last rank's is cut at the group's end: ``_get_groups_without_padding``), where the group's
  parameters lie one after the other in ``param_shapes[g]`` order, each followed by
  ``param_alignment_paddings[g][i]`` elements (utils/zero_to_fp32.py
  ``_zero2_merge_trainable_params``); ``base_optimizer_state`` is torch Adam's state dict whose
  ``state[g]`` ``exp_avg`` / ``exp_avg_sq`` have the partition's layout (a list of those per group
  when ``elastic_checkpoint`` is on).
* ZeRO 3 (runtime/zero/stage3.py ``_rigid_state_dict``): every parameter of ``n`` elements is
  cut into ``ceil(n / W)``-element pieces, rank ``r`` holding elements ``[r * q, (r + 1) * q)``;
  a rank's ``fp32_flat_groups`` (concatenated over groups) hold its pieces in ``param_shapes``
  order (utils/zero_to_fp32.py ``_zero3_merge_trainable_params``, ``zero3_partitioned_param_info``),
  ``optimizer_state_dict["state"][g]`` the moments in the same layout.

These become a :class:`~megazero.checkpoint.engine.ShardPieces` (one rank's flat vectors per
saved rank), so the engine's own range loading fills each rank's shard whatever its layout.

The optim-states files pickle four DeepSpeed classes (``ZeroStageEnum``, ``LossScaler``,
``DynamicLossScaler``, ``fragment_address``); they are read with ``weights_only=True`` and only
those names allowed, each mapped to a plain stand-in here (no DeepSpeed import needed).
"""

from __future__ import annotations

import math
import os

import torch

from megazero.checkpoint import engine as engine_files
from megazero.checkpoint.files import read_file
from megazero.checkpoint.schema import CheckpointError

WHO = "engine.load_checkpoint"
MODEL_12 = "mp_rank_00_model_states.pt"


class Record:
    """Stand-in for a pickled DeepSpeed object: its attributes, nothing else."""


class LossScalerRecord(Record):
    pass


class DynamicLossScalerRecord(Record):
    pass


class FragmentAddressRecord(Record):
    pass


class StageNumber(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``int`` Enum)."""


SAFE = [(StageNumber, "deepspeed.runtime.zero.config.ZeroStageEnum"),
        (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (DynamicLossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
        (FragmentAddressRecord, "deepspeed.utils.tensor_fragment.fragment_address")]

# keys of the model-states file that are DeepSpeed's (engine.py ``_save_checkpoint``); the rest is
# the caller's client_state
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions"}


def _model_file(folder: str, stage3: bool, r: int = 0) -> str:
    return os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage3 else MODEL_12)


def _optim_file(folder: str, r: int) -> str:
    plain = os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    bf16 = os.path.join(folder, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return bf16 if not os.path.isfile(plain) and os.path.isfile(bf16) else plain


def load_file(path: str) -> dict:
    """One DeepSpeed file, ``weights_only=True`` with only :data:`SAFE`'s DeepSpeed names allowed,
    opened with ``mmap`` (a rank copies only the overlap with its shard): :func:`megazero.checkpoint.
    files.read_file`."""
    return read_file(path, mmap=True, who=WHO, allowed=SAFE)


def folder_of(load_dir: str, tag) -> str | None:
    """The folder ``tag`` (or ``latest``'s) names when it is DeepSpeed's layout, else None."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(load_dir, str(tag))
    if os.path.isfile(os.path.join(folder, engine_files.META)):
        return None
    if os.path.isfile(_model_file(folder, False)) or os.path.isfile(_model_file(folder, True)):
        return folder
    return None


def _fail(path: str, cause: str):
    raise CheckpointError(f"{WHO}: {path}: {cause}")


def _optim_state(path: str, sd: dict) -> tuple[list, list]:
    """(fp32 flat vectors per group, ``{exp_avg, exp_avg_sq}`` per group) of one optim-states file."""
    osd = sd.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        _fail(path, "no 'optimizer_state_dict' (not a DeepSpeed ZeRO optim-states file)")
    if "fp32_flat_groups" in osd:
        flats, base = osd["fp32_flat_groups"], osd["optimizer_state_dict"]
    elif "single_partition_of_fp32_groups" in osd:
        flats, base = osd["single_partition_of_fp32_groups"], osd["base_optimizer_state"]
    else:
        _fail(path, "no 'single_partition_of_fp32_groups' or 'fp32_flat_groups' "
                    "(a ZeRO stage this reader does not map)")
    states = base if isinstance(base, list) else [base["state"].get(g, {}) for g in range(len(flats))]
    return list(flats), states


def _shards(flats: list, states: list, stage3: bool) -> list:
    """One rank's saved shards as ShardPieces wants them: per group (ZeRO 1/2) or one concatenated
    vector (ZeRO 3) of ``master`` / ``exp_avg`` / ``exp_avg_sq`` (zeros where no moments were saved)."""
    def kinds(flat, st):
        zeros = torch.zeros_like(flat)
        return {"master": flat.float(), "exp_avg": st.get("exp_avg", zeros).float(),
                "exp_avg_sq": st.get("exp_avg_sq", zeros).float()}
    per = [kinds(f, s) for f, s in zip(flats, states)]
    if not stage3:
        return per
    return [{k: torch.cat([p[k] for p in per]) for k in ("master", "exp_avg", "exp_avg_sq")}]


def _pieces(shapes: list, lengths: list, paddings, stage3: bool, world: int) -> dict:
    """``name -> [(a, b, rank, k, lo)]`` (module doc: DeepSpeed's flat layouts)."""
    pieces: dict[str, list] = {}
    offset = 0  # ZeRO 3: position in every rank's concatenated vector
    for g, group in enumerate(shapes):
        o = 0  # ZeRO 1/2: position in group g's unpartitioned flat vector
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            if stage3:
                q = math.ceil(n / world)
                for r in range(world):
                    a, b = min(r * q, n), min((r + 1) * q, n)
                    if a < b:
                        pieces.setdefault(name, []).append((a, b, r, 0, offset))
                offset += q
                continue
            part = lengths[g]
            for r in range(world):
                a, b = max(o, r * part), min(o + n, (r + 1) * part)
                if a < b:
                    pieces.setdefault(name, []).append((a - o, b - o, r, g, a - r * part))
            o += n + (paddings[g][i] if paddings else 0)
    return pieces


class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint folder opened for the engine: ``model`` (rank 0's model-states
    dict), ``stage3``, ``world`` (its DP size), ``shapes`` (name -> shape), ``shards``
    (:class:`~megazero.checkpoint.engine.ShardPieces`) and ``counters`` of rank 0's optim file."""

    def __init__(self, folder: str):
        self.folder = folder
        self.stage3 = not os.path.isfile(_model_file(folder, False))
        self.model_path = _model_file(folder, self.stage3)
        self.model = load_file(self.model_path)
        if self.model.get("mp_world_size", 1) != 1:
            _fail(self.model_path, f"saved with model parallel size {self.model['mp_world_size']}; this reader maps 1")
        if not isinstance(self.model.get("param_shapes"), list) or "dp_world_size" not in self.model:
            _fail(self.model_path, "no 'param_shapes' list or 'dp_world_size' (not a DeepSpeed model-states file)")
        self.world = int(self.model["dp_world_size"])
        if self.model.get("optimizer") is not None and not os.path.isfile(_optim_file(folder, 0)):
            _fail(self.model_path, "saved without ZeRO (the optimizer inside the model-states file); "
                                   "this reader maps ZeRO 1, 2 and 3")
        files, lengths, paddings = [], None, None
        for r in range(self.world):
            path = _optim_file(folder, r)
            sd = load_file(path)
            flats, states = _optim_state(path, sd)
            osd = sd["optimizer_state_dict"]
            count = osd.get("partition_count")
            count = count[0] if isinstance(count, list) else count
            if count is not None and int(count) != self.world:
                _fail(path, f"partitioned over {count} ranks but {self.model_path} says dp_world_size {self.world}")
            if r == 0:
                lengths, paddings = [f.numel() for f in flats], osd.get("param_alignment_paddings")
                self.counters = {"step": states[0].get("step", self.model["global_steps"]) if states else 0,
                                 "scaler": osd.get("loss_scaler")}
                self.opt_path = path
            elif len(flats) != len(lengths) or any(f.numel() > n for f, n in zip(flats, lengths)):
                _fail(path, f"flat group sizes {[f.numel() for f in flats]} do not fit rank 0's {lengths}")
            files.append({"shards": _shards(flats, states, self.stage3)})
        self.shapes = {n: list(s) for group in self.model["param_shapes"] for n, s in group.items()}
        self.shards = engine_files.ShardPieces(files, _pieces(self.model["param_shapes"], lengths, paddings,
                                                              self.stage3, self.world))


def _check_model(ckpt: DeepSpeedCheckpoint, module) -> None:
    """The engine's trainable parameters (canonical names) must be the checkpoint's, same shapes."""
    name_of, _ = engine_files.names(module)
    mine = {name_of[id(p)]: list(p.shape) for p in module.parameters() if p.requires_grad}
    if mine != ckpt.shapes:
        diff = next(n for n in sorted(set(mine) | set(ckpt.shapes)) if mine.get(n) != ckpt.shapes.get(n))
        _fail(ckpt.model_path, f"holds another model (parameter {diff!r}: saved {ckpt.shapes.get(diff)}, "
                               f"here {mine.get(diff)})")


def _scheduler_state(ckpt: DeepSpeedCheckpoint, scheduler) -> dict:
    """DeepSpeed's WarmupLR family saves ``{'last_batch_iteration': i}`` (runtime/lr_schedules.py
    0.19.8 ``state_dict``; -1 before the first step, its rate that of step ``i``); megazero's
    config schedulers count ``num_steps = i + 1`` (:mod:`megazero.optim.lr_schedule`), their
    settings being this run's config. Any other state is handed over as saved."""
    saved, mine = ckpt.model["lr_scheduler"], scheduler.state_dict()
    if isinstance(saved, dict) and set(saved) == {"last_batch_iteration"} and "num_steps" in mine:
        return {**mine, "num_steps": int(saved["last_batch_iteration"]) + 1}
    return saved


def scaler_state(record, scaler) -> dict:
    """The engine scaler's state from DeepSpeed's pickled one: ``cur_scale``, and a
    ``DynamicLossScaler``'s ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis`` copied into
    a dynamic engine scaler's (both follow DeepSpeed's rule,
    :class:`megazero.zero.loss_scaler.DeepSpeedLossScaler`). Inverse of
    :func:`megazero.checkpoint.deepspeed_writer.loss_scaler_record`."""
    mine = scaler.state_dict()
    out = {**mine, "scale": float(record.cur_scale)}
    if "cur_iter" in mine and getattr(record, "dynamic", False):
        for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
            out[key] = int(getattr(record, key, mine[key]))
    return out


@torch.no_grad()
def _load_frozen(ckpt: DeepSpeedCheckpoint, module, name_of: dict) -> None:
    """Frozen parameters (in no optimizer group) as DeepSpeed saved them: ZeRO 1/2 in ``module``
    (whole), ZeRO 3 as every rank's ``frozen_param_fragments`` piece (engine.py
    ``_load_checkpoint`` / utils/zero_to_fp32.py ``_zero3_merge_frozen_params``)."""
    frozen = [(name_of[id(p)], p) for p in module.parameters() if not p.requires_grad]
    if not frozen:
        return
    if not ckpt.stage3:
        saved = ckpt.model.get("module") or {}
        for name, p in frozen:
            if name not in saved:
                _fail(ckpt.model_path, f"no frozen parameter {name!r} in 'module'")
            p.copy_(saved[name])
        return
    pieces = [load_file(_model_file(ckpt.folder, True, r)).get("frozen_param_fragments") or {}
              for r in range(ckpt.world)]
    for name, p in frozen:
        if any(name not in got for got in pieces):
            _fail(ckpt.model_path, f"no 'frozen_param_fragments' of {name!r} in every rank's model-states file")
        p.copy_(torch.cat([got[name].reshape(-1) for got in pieces])[:p.numel()].view(p.shape))


def load(engine, folder: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True):
    """Fill the engine from DeepSpeed's files in ``folder`` (collective; every rank reads every
    saved rank's partition and keeps the overlap with its own shard). Returns ``(folder,
    client_state)``: the model-states keys that are not DeepSpeed's (:data:`DS_KEYS`)."""
    ckpt = DeepSpeedCheckpoint(folder)
    zero, module = engine.zero, engine.module
    _check_model(ckpt, module)
    name_of, _ = engine_files.names(module)
    kinds = engine_files.KINDS if load_optimizer_states else ("weight",)

    def fetch(p, kind, a, b):
        return ckpt.shards.read(name_of[id(p)], "master" if kind == "weight" else kind, a, b)
    zero.load_param_ranges(fetch, kinds)
    if load_optimizer_states:
        zero.iteration = int(ckpt.counters["step"])
        if getattr(ckpt.counters["scaler"], "cur_scale", None) is not None:
            zero.scaler.load_state_dict(scaler_state(ckpt.counters["scaler"], zero.scaler))
    _load_frozen(ckpt, module, name_of)
    saved_module = ckpt.model.get("module") or {}
    with torch.no_grad():
        for key in ckpt.model.get("buffer_names") or []:
            if key in saved_module:
                module.get_buffer(key).copy_(saved_module[key])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and ckpt.model.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(_scheduler_state(ckpt, engine.lr_scheduler))
    engine.global_steps = int(ckpt.model["global_steps"])
    engine.skipped_steps = int(ckpt.model.get("skipped_steps", 0))
    engine.global_samples = int(ckpt.model.get("global_samples", 0))
    engine.micro_steps = engine_files.resumed_micro_steps(engine.global_steps, engine.gradient_accumulation_steps())
    return folder, {k: v for k, v in ckpt.model.items() if k not in DS_KEYS}
