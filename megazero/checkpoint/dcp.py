"""``--ckpt-format torch_dcp``: a run's checkpoint as a PyTorch Distributed Checkpoint (DCP) folder.

On disk (``DIR/iter_NNNNNNN/``): DCP's ``.metadata`` and ``__R_0.distcp`` files (written by
``torch.distributed.checkpoint.save`` with a ``FileSystemWriter``), plus megazero's
``metadata.json`` (iteration, consumed samples, layout, args, LR scheduler, optimizer counters,
``"format": "torch_dcp"``; no index). ``dcp_to_torch_save(DIR/iter_N, out.pt)`` gives one state
dict of full fp32 tensors:

* ``<HF name>``: the fp32 master weights, under ``transformers``' names
  (:mod:`.dcp_names`): equal to ``tools/convert_checkpoint.py to-fp32``'s tensors mapped by
  :func:`megazero.checkpoint.convert.hf.full_to_hf` (a tied ``lm_head`` left out);
* ``optimizer.state.<HF name>.exp_avg`` / ``.exp_avg_sq``: the Adam moments (unless
  ``--no-save-optim``); the step count is ``metadata.json``'s ``optimizer.iteration``.

Nothing is gathered: each rank writes the rectangles of its own fp32 ZeRO shards (a shard is a
flat range of several parameters; each parameter's part is a partial row, whole rows and a
partial row: :func:`.dcp_names.flat_rectangles`) through a :class:`ShardPlanner`, a
``DefaultSavePlanner`` whose local plan lists those rectangles as ``WriteItem`` chunks (DCP's
public planner API: no DTensor needed, uneven and vocabulary-padded pieces allowed).
Replicas are written once: ZeRO 0 by DP rank 0, TP-replicated parameters by TP rank 0. Crash
safe as megazero's format: ``iter_N.tmp/``, every rank's write agreed, rename, pointer last.

Loading (:func:`load_dcp`) at any layout: each rank asks, per parameter it holds, for the
elements of its new ZeRO shard (:meth:`ZeroOptimizer.load_param_ranges`); the parameter's full
tensors are read one at a time with ``dcp.load(..., no_dist=True)`` (bounded memory: one
parameter's HF tensors) and sliced by the TP split rule. Missing or short ``.distcp`` files are
refused first, in one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megazero.checkpoint import files, schema
from megazero.checkpoint.dcp_names import flat_rectangles, full_from_hf, hf_sources, model_pieces
from megazero.checkpoint.api import Loaded
from megazero.checkpoint.reshard import load_from_full, model_mismatch_message, named_parameters
from megazero.checkpoint.schema import CheckpointError
from megazero.config.failures import describe
from megazero.model.saved_args import model_arg_diffs

FORMAT = schema.TORCH_DCP
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIM_PREFIX = "optimizer.state."


class ShardPlanner(DefaultSavePlanner):
    """Saves the given :class:`~.dcp_names.Piece` rectangles (each a chunk of its full tensor);
    the global plan, its validation (every tensor covered, no overlap) and the metadata are
    ``DefaultSavePlanner``'s."""

    def __init__(self, pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.fqn, p.offsets): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.fqn, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(p.offsets), p.tensor.size()),
                               properties=TensorProperties.create_from_tensor(p.tensor), size=torch.Size(p.size)))
                 for p in self.pieces.values()]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.pieces[(index.fqn, tuple(index.offset))].tensor


def cause(error: BaseException, folder: str) -> str:
    """One line for a DCP failure: a ``CheckpointException`` (a ``BaseException`` holding each
    failed rank's exception and traceback) as its first rank's exception, described (``folder``:
    the file named when the error names none)."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, (first, _) = next(iter(sorted(error.failures.items(), key=lambda kv: kv[0])))
        text = f"DCP rank {rank}: {describe(first, default_file=folder)}"
    else:
        text = describe(error, default_file=folder)
    text = " ".join(text.split())  # torch.load's messages span lines
    return text if len(text) <= 400 else text[:400] + " ..."


def rank_pieces(topo, stages, optimizer, config, save_optim: bool) -> list:
    """The rectangles this rank writes: its fp32 master (and moment) shards, cut per parameter."""
    info = {id(p): (name, tuple(p.shape), split) for _, name, _, _, p, split in named_parameters(stages.chunks)}
    name_of = {k: v[0] for k, v in info.items()}
    by_name = {v[0]: v for v in info.values()}
    if optimizer.stage == 0 and topo.dp_cp_rank != 0:
        return []
    kinds = ("master",) + (MOMENTS if save_optim else ())
    shards = optimizer.state_dict(shards=True, copy=False)["shards"]
    pieces = []
    for region, shard in zip(optimizer.layout(name_of), shards):
        lo, length = region["shard_lo"], region["shard_len"]
        for name, offset, numel in region["params"]:
            _, shape, split = by_name[name]
            a, b = max(offset, lo), min(offset + numel, lo + length)
            if b <= a or name in stages.aliases or (split is None and topo.tp_rank != 0):
                continue
            for roff, sizes, k0, k1 in flat_rectangles(shape, a - offset, b - offset):
                for kind in kinds:
                    flat = shard[kind][offset - lo + k0: offset - lo + k1]
                    pieces += model_pieces(name, flat.view(sizes), config, split=split, tp_rank=topo.tp_rank,
                                           tp=topo.tp, local_shape=shape, roff=roff,
                                           prefix="" if kind == "master" else OPTIM_PREFIX,
                                           suffix="" if kind == "master" else f".{kind}", shift=kind == "master")
    return pieces


def save_dcp(root: str, *, topo, stages, optimizer, model_config, scheduler_state, counters: dict, iteration: int,
             consumed_samples: int, layout: dict, saved_args: dict, save_optim: bool = True) -> str:
    """Write checkpoint ``iteration`` under ``root`` as a DCP folder and publish it; returns the
    folder. Collective over every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = schema.iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    pieces = rank_pieces(topo, stages, optimizer, model_config, save_optim)
    error = None
    try:
        dcp.save({f"{p.fqn}@{p.offsets}": p.tensor for p in pieces}, storage_writer=FileSystemWriter(tmp),
                 planner=ShardPlanner(pieces))
    except (Exception, dcp.CheckpointException) as e:  # reported on every rank by agree_on_writes
        error = f"{tmp}: {cause(e, tmp)}"
    files.agree_on_writes(error, rank, tmp, "saving the DCP checkpoint", "the previous checkpoint is kept")
    if rank == 0:
        opt = optimizer.state_dict(shards=False)
        opt.pop("shards", None)
        meta = schema.metadata(iteration, consumed_samples, layout, saved_args, None, **{
            schema.FORMAT: FORMAT, schema.SCHEDULER: scheduler_state, schema.COUNTERS: counters,
            schema.OPTIMIZER: opt if save_optim else None})
        files.atomic_write_text(schema.metadata_file(tmp), json.dumps(meta, indent=1, sort_keys=True))
        files.replace_folder(tmp, final)
        files.atomic_write_text(schema.latest_file(root), f"{iteration}\n")
    if dist.is_initialized():
        dist.barrier()
    return final


def is_dcp(root: str, iteration: int) -> bool:
    """Whether ``iter_<iteration>`` under ``root`` is a DCP folder (it has DCP's ``.metadata``)."""
    return os.path.exists(os.path.join(schema.iteration_dir(root, iteration), ".metadata"))


def check_dcp_files(folder: str):
    """DCP's metadata of ``folder``, after checking every file it names is there and long enough:
    else :class:`CheckpointError`, one line naming the file."""
    if not os.path.exists(os.path.join(folder, ".metadata")):
        raise CheckpointError(f"{os.path.join(folder, '.metadata')} is missing: not a complete DCP checkpoint")
    metadata = FileSystemReader(folder).read_metadata()
    ends = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        path = os.path.join(folder, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the DCP checkpoint lacks a shard (.metadata names it)")
        if os.path.getsize(path) < end:
            raise CheckpointError(f"{path} is truncated: {os.path.getsize(path)} bytes, .metadata needs {end}")
    return metadata


def _reader(folder: str, metadata, config):
    """``read(name, kind)``: megazero's full fp32 tensor ``name`` (``kind`` ``master``/``weight``
    or a moment) from the DCP folder, its HF tensors read alone (``dcp.load``, no collective)."""
    sizes = {fqn: md.size for fqn, md in metadata.state_dict_metadata.items()}
    files_of = {}
    for index, info in (metadata.storage_data or {}).items():
        files_of.setdefault(index.fqn, set()).add(os.path.join(folder, info.relative_path))

    def read(name: str, kind: str) -> torch.Tensor:
        pre, post = ("", "") if kind in ("master", "weight") else (OPTIM_PREFIX, f".{kind}")
        state = {}
        for src in hf_sources(name, config):
            if pre + src + post not in sizes:
                raise CheckpointError(f"{folder}: no tensor {pre + src + post!r} (parameter {name}'s {kind})")
            state[pre + src + post] = torch.empty(sizes[pre + src + post], dtype=torch.float32)
        try:
            dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=True)
        except (Exception, dcp.CheckpointException) as e:
            paths = sorted(set().union(*(files_of.get(k, set()) for k in state)))
            raise CheckpointError(f"{' or '.join(paths)}: cannot read {', '.join(state)}: {cause(e, folder)}") from None
        full = full_from_hf(name, {k[len(pre):len(k) - len(post)]: v for k, v in state.items()}, config)
        if post and config.apply_layernorm_1p and name.endswith("norm.weight"):
            full = full + 1  # a moment is not shifted (full_from_hf took 1 off, as from a weight)
        return full
    return read


def load_dcp(root: str, iteration: int, *, topo, stages, optimizer, model_config, load_optim: bool = True,
             finetune: bool = False) -> Loaded:
    """Load DCP checkpoint ``iteration`` under ``root`` into this run's layout (any TP, PP, VP,
    DP, ZeRO stage): weights (the fp32 masters), and unless ``load_optim`` is False both Adam
    moments and the optimizer's counters. RNG states are not restored. Collective (the ZeRO
    write-back)."""
    folder = schema.iteration_dir(root, iteration)
    meta = files.read_metadata(root, iteration)
    diffs = model_arg_diffs(meta.get(schema.ARGS, {}), model_config.to_args())
    if diffs:
        raise CheckpointError(model_mismatch_message(folder, diffs))
    with_optim = load_optim and meta.get(schema.OPTIMIZER) is not None
    read = _reader(folder, check_dcp_files(folder), model_config)
    load_from_full(read, stages, optimizer, ("master",) + MOMENTS if with_optim else ("weight",))
    if with_optim:
        counters = dict(meta[schema.OPTIMIZER])
        if set(counters["scaler"]) != set(optimizer.scaler.state_dict()):
            counters["scaler"] = optimizer.scaler.state_dict()
        optimizer.load_counters(counters)
    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"loaded DCP checkpoint {folder} into {topo.tp=}, {topo.pp=}, {topo.dp=}; note: RNG states are "
              "not restored from a DCP checkpoint, this run's --seed streams are used", flush=True)
    if finetune:
        return Loaded(FORMAT, 0, 0, None, None)
    return Loaded(FORMAT, meta[schema.ITERATION], meta[schema.CONSUMED_SAMPLES], meta.get(schema.SCHEDULER),
                  meta.get(schema.COUNTERS))
