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
from megazero.checkpoint.schema import CheckpointError

KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")


class CheckpointReader:
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
        self.args = dict(self.metadata.get(schema.ARGS, {}))
        self.layout = self.metadata.get(schema.LAYOUT, {})
        self.ranks, self.aliases = schema.read_index(self.metadata, schema.metadata_file(self.directory))
        self.tp = int(self.layout["tensor_model_parallel_size"])
        self.has_optimizer = not self.args.get("no_save_optim", False)
        self._files: dict[int, dict] = {}
        self._where: dict[str, list] = {}     # name -> [(tp_rank, dp_rank, rank, ParamEntry)]
        self._regions: dict[str, list] = {}   # name -> [(tp_rank, dp_rank, rank, region, offset, numel, lo, len)]
        self._order: list[tuple] = []         # (virtual stage, position, name) on TP rank 0, DP rank 0
        pp = int(self.layout["pipeline_model_parallel_size"])
        for e in self.ranks:
            t, d, r = e["tp_rank"], e["dp_rank"], e["rank"]
            for pos, p in enumerate(schema.entry_params(e)):
                self._where.setdefault(p.name, []).append((t, d, r, p))
                if t == 0 and d == 0:
                    self._order.append((p.chunk * pp + e["pp_rank"], pos, p.name))
            for ri, reg in enumerate(e["regions"]):
                for name, off, numel in reg["params"]:
                    self._regions.setdefault(name, []).append(
                        (t, d, r, ri, off, numel, reg["shard_lo"], reg["shard_len"]))
        for v in self._where.values():
            v.sort(key=lambda x: (x[0], x[1]))
        for v in self._regions.values():
            v.sort(key=lambda x: (x[0], x[1]))

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

    # ---- description -------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        """Every parameter once, in model order (virtual stage, then position in the chunk); an
        alias is left out when its canonical parameter is saved."""
        names = []
        for _, _, name in sorted(self._order):
            if name not in names and self.aliases.get(name) not in self._where:
                names.append(name)
        return names

    def resolve(self, name: str) -> str:
        """The saved name holding ``name``'s tensor (itself, or its alias's canonical name);
        ``KeyError`` naming the checkpoint when there is none."""
        if name not in self._where and self.aliases.get(name) in self._where:
            return self.aliases[name]
        if name not in self._where:
            raise KeyError(f"{self.directory}: no parameter {name!r} in this checkpoint")
        return name

    # ---- tensors -----------------------------------------------------------------------------
    def _weight(self, name: str, tp_rank: int) -> torch.Tensor:
        _, _, rank, p = next(w for w in self._where[name] if w[0] == tp_rank)
        try:
            return self.rank_state(rank)[schema.MODEL][p.chunk][name]
        except (KeyError, IndexError, TypeError):
            path = schema.rank_file(self.directory, rank)
            raise CheckpointError(f"{path}: model chunk {p.chunk} lacks {name!r}") from None

    def _local(self, name: str, kind: str, tp_rank: int, shape: tuple) -> torch.Tensor:
        """The TP-local tensor of ``name`` on ``tp_rank`` (weight: saved dtype; else fp32)."""
        if kind == "weight" or (kind == "master" and not self.has_optimizer):
            w = self._weight(name, tp_rank)
            return w if kind == "weight" else w.float()
        if not self.has_optimizer:
            raise CheckpointError(f"{self.directory} was saved with --no-save-optim: no {kind}")
        numel = 1
        for s in shape:
            numel *= s
        flat, done = torch.zeros(numel, dtype=torch.float32), 0
        for t, d, rank, ri, o, n, lo, ln in self._regions.get(name, []):
            if t != tp_rank or done >= numel:
                continue
            a, b = max(o, lo), min(o + n, lo + ln)
            if a >= b:
                continue
            try:
                shard = self.rank_state(rank)[schema.OPTIMIZER][schema.SHARDS][ri][kind]
            except (KeyError, IndexError, TypeError):
                path = schema.rank_file(self.directory, rank)
                raise CheckpointError(f"{path}: no optimizer region {ri}") from None
            flat[a - o:b - o] = shard[a - lo:b - lo]
            done += b - a
        if done != numel:
            raise CheckpointError(f"{self.directory}: the optimizer shards of {name!r} cover {done} of "
                                  f"{numel} elements")
        return flat.view(shape)

    def full_param(self, name: str, kind: str = "weight") -> torch.Tensor:
        """The full, unpadded tensor of ``name``: ``weight`` in the saved dtype, ``master``,
        ``exp_avg`` or ``exp_avg_sq`` in fp32 (vocabulary matrices: ``real_rows`` rows)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} not in {KINDS}")
        name = self.resolve(name)
        entry = self._where[name][0][3]
        if entry.split is None:
            return self._local(name, kind, 0, entry.shape).clone()
        pieces = [self._local(name, kind, t, entry.shape) for t in range(self.tp)]
        return entry.split.to_full(pieces).clone()

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
