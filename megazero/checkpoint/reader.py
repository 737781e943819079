"""Read any megazero checkpoint as full, layout-free tensors, one parameter at a time.

The format (paths, keys, the index) is :mod:`megazero.checkpoint.schema`'s. The reader knows no
model: names, TP split rules and aliases all come from the checkpoint's index.

The weight of ``name`` on TP rank ``t`` is ``file["model"][chunk][name]`` in any DP replica's
file.  Its fp32 master and Adam moments live in flat ZeRO regions: the parameter occupies
``[offset, offset + numel)`` of its region and DP rank ``d`` holds ``[shard_lo, shard_lo +
shard_len)`` of it in ``file["optimizer"]["shards"][region][kind]``, so the TP-local flat tensor
is reassembled from the overlaps ``[max(o, lo), min(o + n, lo + len))`` of the DP ranks' shards
(ZeRO 0: every replica holds everything; the first one suffices).  The full tensor is then
:meth:`TPSplit.to_full` of the TP-local tensors (``unshard``, cut to ``real_rows``).

Files are opened with ``torch.load(weights_only=True, mmap=True)``: only the bytes of the
tensors actually touched are read.  Aliases (``{copy: canonical}``, e.g. a tied output layer):
a copy that no rank saved reads as its canonical parameter, and :meth:`param_names` lists a copy
only when it was saved and its canonical was not.
"""

from __future__ import annotations

import torch

from megazero.checkpoint import files, schema
from megazero.checkpoint.resplit import ResplitReads
from megazero.checkpoint.schema import CheckpointError

KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")


class CheckpointReader(ResplitReads):
    """``CheckpointReader(load_dir, iteration=None)``: the latest iteration unless given.

    Attributes: ``metadata`` (metadata.json), ``args`` (the saving run's arguments, a dict),
    ``iteration``, ``layout``, ``directory``, ``ranks`` (the index entries), ``aliases``.
    Raises :class:`CheckpointError` naming the file when a file is missing, truncated, or holds
    anything but tensors and plain values.
    """

    def __init__(self, load_dir: str, iteration: int | None = None):
        if iteration is None:
            iteration = files.latest_iteration(load_dir)
            if iteration is None:
                raise CheckpointError(f"{load_dir}: no {schema.LATEST} (no checkpoint saved there)")
        self.root, self.iteration = load_dir, int(iteration)
        self.directory = schema.iteration_dir(load_dir, self.iteration)
        self.metadata = files.read_metadata(load_dir, self.iteration)
        if self.metadata.get(schema.FORMAT) == schema.TORCH_DCP:
            raise CheckpointError(f"{self.directory} is a PyTorch DCP checkpoint (--ckpt-format torch_dcp): load it "
                                  "with --load, or make one file of it with torch.distributed.checkpoint."
                                  "format_utils.dcp_to_torch_save")
        self.args = dict(self.metadata.get(schema.ARGS, {}))
        self.layout = self.metadata.get(schema.LAYOUT, {})
        self.ranks, self.aliases = schema.read_index(self.metadata, schema.metadata_file(self.directory))
        self.version = schema.index_version(self.metadata)
        self.tp = int(self.layout["tensor_model_parallel_size"])
        self.etp = int(schema.layout_value(self.layout, "expert_tensor_parallel_size") or self.tp)
        self.has_optimizer = not self.args.get("no_save_optim", False)
        self.bytes_read = 0  # tensor bytes copied out of the (memory-mapped) files so far
        self._files: dict[int, dict] = {}
        self._where: dict[str, list] = {}     # name -> [(tp_rank, dp_rank, rank, ParamEntry)] holding its weight
        self._regions: dict[str, list] = {}   # name -> [(tp_rank, dp_rank, rank, region, offset, numel, lo, len,
        self._order: list[tuple] = []         #           partitioned, optimizer saved)]; (vstage, pos, ..., name)
        self._size: dict[str, int] = {}       # name -> how many TP pieces (a routed expert's: expert TP)
        self._buffers: set[str] = set()
        self._writers: dict[tuple, tuple] = {}  # (tp rank, region params) -> (rank, region) saving its fp32 state
        for e in self.ranks:
            self._scan(e)
        for v in self._where.values():
            v.sort(key=lambda x: (x[0], x[1]))
        for v in self._regions.values():
            v.sort(key=lambda x: (x[0], x[1]))

    def _scan(self, e: dict) -> None:
        """Record where rank entry ``e``'s file holds each weight, buffer and region. Tensor-
        and data-parallel coordinates are those of the parameter's grid (a routed expert's:
        expert TP and expert DP, :func:`schema.grid_ranks`); a run of expert parameters is
        ordered at its position, by EP rank, so :meth:`param_names` is the same for any EP."""
        pp, zero = int(self.layout["pipeline_model_parallel_size"]), int(self.layout.get("zero_stage") or 0)
        params, run = schema.entry_params(e), None
        for pos, p in enumerate(params):
            t, d = schema.grid_ranks(e, p.expert)
            self._size[p.name] = self.etp if p.expert else self.tp
            if p.stored is not None:
                self._where.setdefault(p.name, []).append((t, d, e["rank"], p))
            run = (pos if run is None else run) if p.expert else None
            if t == 0 and d == 0:
                place = (run, e.get("ep_rank", 0), pos) if p.expert else (pos, 0, pos)
                self._order.append((p.chunk * pp + e["pp_rank"], *place, p.name))
        for b in schema.entry_buffers(e):
            self._size[b.name] = self.tp
            self._buffers.add(b.name)
            if b.stored is not None:
                self._where.setdefault(b.name, []).append((e["tp_rank"], e["dp_rank"], e["rank"], b))
        experts = {p.name for p in params if p.expert}
        for ri, reg in enumerate(e["regions"]):
            t, d = _region_grid(e, reg, experts)
            saved_opt = self.version < 3 or zero >= 1 or d == 0  # v3+, ZeRO 0: DP rank 0 writes the replicas
            if saved_opt and self.has_optimizer:
                self._writers.setdefault((t, _region_key(reg)), (e["rank"], ri))
            for name, off, numel in reg["params"]:
                self._regions.setdefault(name, []).append(
                    (t, d, e["rank"], ri, off, numel, reg["shard_lo"], reg["shard_len"],
                     reg.get("partitioned", False), saved_opt))

    # ---- files -------------------------------------------------------------------------------
    def rank_state(self, rank: int) -> dict:
        """Rank ``rank``'s file, memory-mapped (tensors are read when touched), cached."""
        if rank not in self._files:
            self._files[rank] = files.load_rank_state(self.root, self.iteration, rank, mmap=True)
        return self._files[rank]

    def close(self) -> None:
        self._files.clear()

    def rank_index(self, rank: int) -> dict:
        return self.ranks[rank]

    def replica_shards(self, rank: int) -> list:
        """ZeRO 0: the fp32 state of each of ``rank``'s regions, from the file that saved that
        region (DP rank 0 of its grid at the same position: the replicas are equal)."""
        e, out = self.ranks[rank], []
        experts = {p.name for p in schema.entry_params(e) if p.expert}
        for reg in e["regions"]:
            t, _ = _region_grid(e, reg, experts)
            src = self._writers.get((t, _region_key(reg)))
            if src is None:
                raise CheckpointError(f"{self.directory}: no file holds the fp32 state of rank {rank}'s region "
                                      f"starting with {reg['params'][0][0] if reg['params'] else None!r}")
            out.append(self._source(src[0], (schema.OPTIMIZER, schema.SHARDS, src[1])))
        return out

    # ---- description -------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        """Every parameter once, in model order (virtual stage, then position in the chunk); an
        alias is left out when its canonical parameter is saved."""
        names = []
        for *_, name in sorted(self._order):
            if name not in names and self.aliases.get(name) not in self._where:
                names.append(name)
        return names

    def has_buffer(self, name: str) -> bool:
        """Whether the checkpoint saved persistent buffer ``name`` (read it with :meth:`full_param`)."""
        return name in self._buffers and name in self._where

    def resolve(self, name: str) -> str:
        """The saved name holding ``name``'s tensor (itself, or its alias's canonical name);
        ``KeyError`` naming the checkpoint when there is none."""
        if name not in self._where and self.aliases.get(name) in self._where:
            return self.aliases[name]
        if name not in self._where:
            raise KeyError(f"{self.directory}: no parameter {name!r} in this checkpoint")
        return name

    # ---- tensors -----------------------------------------------------------------------------
    def _source(self, rank: int, path: tuple):
        """``rank_state(rank)[path[0]][path[1]]...``, or a :class:`CheckpointError` naming the file."""
        obj = self.rank_state(rank)
        try:
            for key in path:
                obj = obj[key]
        except (KeyError, IndexError, TypeError):
            where = schema.rank_file(self.directory, rank)
            raise CheckpointError(f"{where}: no {'/'.join(str(k) for k in path)}") from None
        return obj

    def _flat_range(self, name: str, kind: str, tp_rank: int, numel: int, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of ``name``'s flattened TP-local tensor on ``tp_rank`` (of ``numel``):
        a weight from the file storing it whole (``"model"``), else from the overlaps
        ``[max(o + a, lo), min(o + b, lo + len))`` of the DP ranks' flat shards of its region (fp32
        state, or a ZeRO-3 weight's parameter shards). Only those bytes are read; where one shard
        holds the whole range the result is a view of the memory-mapped file (copy-on-write), so
        a loading rank holds no second copy of a parameter's piece (the vocabulary matrix's fp32
        state: 0.2 GB at 152M)."""
        if kind == "master" and not self.has_optimizer:
            return self._flat_range(name, "weight", tp_rank, numel, a, b).float()
        if kind != "weight" and not self.has_optimizer:
            raise CheckpointError(f"{self.directory} was saved with --no-save-optim: no {kind}")
        if kind == "weight":
            _, _, rank, p = next(w for w in self._where[name] if w[0] == tp_rank)
            if p.stored == schema.STORED_MODEL:
                out = self._source(rank, (schema.MODEL, p.chunk, name)).reshape(-1)[a:b]
                self.bytes_read += out.nbytes
                return out
        out, done = None, 0
        for t, d, rank, ri, o, n, lo, ln, partitioned, saved_opt in self._regions.get(name, []):
            if t != tp_rank or not (partitioned if kind == "weight" else saved_opt):
                continue
            x, y = max(o + a, lo), min(o + b, lo + ln)
            if x >= y:
                continue
            path = (schema.PARAM_SHARDS, ri) if kind == "weight" else (schema.OPTIMIZER, schema.SHARDS, ri, kind)
            shard = self._source(rank, path)
            self.bytes_read += (y - x) * shard.element_size()
            if out is None and (x, y) == (o + a, o + b):  # one shard holds it all: a view, no copy
                return shard[x - lo:y - lo]
            out = torch.zeros(b - a, dtype=shard.dtype) if out is None else out
            out[x - o - a:y - o - a] = shard[x - lo:y - lo]
            done += y - x
            if done >= b - a:
                break
        if done != b - a:
            raise CheckpointError(f"{self.directory}: the saved shards of {name!r} ({kind}) cover {done} of "
                                  f"{b - a} elements")
        return out

    def _local(self, name: str, kind: str, tp_rank: int, shape: tuple) -> torch.Tensor:
        """The TP-local tensor of ``name`` on ``tp_rank`` (weight: saved dtype; else fp32)."""
        numel = 1
        for s in shape:
            numel *= s
        return self._flat_range(name, kind, tp_rank, numel, 0, numel).view(shape)

    def local_range(self, name: str, kind: str, tp_rank: int, tp: int, shape: tuple, a: int, b: int,
                    to_local) -> torch.Tensor:
        """Elements ``[a, b)`` of the flattened TP-local tensor of ``name`` (``kind``) of shape
        ``shape`` on TP rank ``tp_rank`` of ``tp`` in the *loading* layout. With the saved TP size
        and local shape, read directly (:meth:`_flat_range`); otherwise ``to_local(full)`` of the
        full tensor (the TP size changed: one full parameter in memory)."""
        name = self.resolve(name)
        entry = next(w[3] for w in self._where[name] if w[0] == min(tp_rank, self._size[name] - 1))
        if tp == self._size[name] and tuple(entry.shape) == tuple(shape):
            return self._flat_range(name, kind, tp_rank, entry.numel(), a, b)
        if entry.split is None and tuple(entry.shape) == tuple(shape):  # replicated: any saved copy
            return self._flat_range(name, kind, 0, entry.numel(), a, b)
        if entry.split is not None and (entry.split.dim == 0 or (entry.split.dim == 1 and len(shape) == 2)):
            return self._resplit_range(name, kind, entry, tp_rank, tp, tuple(shape), a, b)
        return to_local(self.full_param(name, kind)).reshape(-1)[a:b]

    def full_param(self, name: str, kind: str = "weight") -> torch.Tensor:
        """The full, unpadded tensor of ``name``: ``weight`` in the saved dtype, ``master``,
        ``exp_avg`` or ``exp_avg_sq`` in fp32 (vocabulary matrices: ``real_rows`` rows)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} not in {KINDS}")
        name = self.resolve(name)
        entry = self._where[name][0][3]
        if entry.split is None:
            return self._local(name, kind, 0, entry.shape).clone()
        pieces = [self._local(name, kind, t, entry.shape) for t in range(self._size[name])]
        return entry.split.to_full(pieces).clone()

    def full_meta(self, name: str, kind: str = "weight") -> torch.Tensor:
        """A meta tensor with :meth:`full_param`'s shape and dtype (nothing is read): the shapes a
        streaming writer needs before the data (``weight``: the saved dtype, else fp32)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} not in {KINDS}")
        entry = self._where[self.resolve(name)][0][3]
        dtype = getattr(torch, self.layout.get("params_dtype") or "float32") if kind == "weight" else torch.float32
        local = torch.empty(entry.shape, dtype=dtype, device="meta")
        return local if entry.split is None else entry.split.to_full([local] * self._size[entry.name])

    def iter_full_params(self, kind: str = "weight", dtype=None):
        """Yield ``(name, full tensor)`` one parameter at a time (see :meth:`param_names`)."""
        for name in self.param_names():
            t = self.full_param(name, kind)
            yield name, (t if dtype is None else t.to(dtype))

    def full_model_state_dict(self, dtype=None, kind: str = "weight") -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` of the whole model, built one parameter at a time."""
        return dict(self.iter_full_params(kind, dtype))

    def optimizer_counters(self) -> dict | None:
        """Optimizer step count, loss-scaler state and skip counters (equal on every rank)."""
        opt = self.rank_state(0).get(schema.OPTIMIZER)
        return None if opt is None else {k: v for k, v in opt.items() if k != schema.SHARDS}


def _region_grid(entry: dict, region: dict, experts: set) -> tuple[int, int]:
    """``(tp_rank, dp_rank)`` of ``entry``'s rank on the grid of ``region`` (its parameters are
    all routed experts', sharded over expert DP, or none are)."""
    return schema.grid_ranks(entry, bool(region["params"]) and region["params"][0][0] in experts)


def _region_key(region: dict) -> tuple:
    """A region's identity across the files of one checkpoint: its ordered ``(name, offset, numel)``."""
    return tuple(tuple(p) for p in region["params"])
