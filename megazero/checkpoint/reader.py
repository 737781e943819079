"""Read any megazero checkpoint as full, layout-free tensors, one parameter at a time.

A checkpoint (see docs/checkpoints.md and :mod:`megazero.checkpoint.files`) is one file per rank
plus ``metadata.json``, whose ``index`` describes every rank's file::

    index = {"ranks": [{"rank": r, "tp_rank": t, "pp_rank": p, "dp_rank": d,
                        "params":  [[chunk, name, local_shape, split], ...],
                        "regions": [{"params": [[name, offset, numel], ...], "padded": P,
                                     "shard_lo": lo, "shard_len": n}, ...]}, ...]}

``split`` is ``None`` for a parameter replicated over TP, else ``[dim, partition_sizes,
real_rows]`` (:mod:`megazero.tensor_parallel.layers`): the full tensor is cut into the logical
blocks ``partition_sizes`` along ``dim`` (one block when None), each split TP ways, and TP rank
``t`` holds block ``t`` of each, concatenated; ``real_rows`` (vocabulary matrices) says how many
rows are real, the rest being zero padding whose amount depends on TP.

The weight of ``name`` on TP rank ``t`` is ``file["model"][chunk][name]`` in any DP replica's
file.  Its fp32 master and Adam moments live in flat ZeRO regions: the parameter occupies
``[offset, offset + numel)`` of its region and DP rank ``d`` holds ``[shard_lo, shard_lo +
shard_len)`` of it in ``file["optimizer"]["shards"][region][kind]``, so the TP-local flat tensor
is reassembled from the overlaps ``[max(o, lo), min(o + n, lo + len))`` of the DP ranks' shards
(ZeRO 0: every replica holds everything; the first one suffices).  The full tensor is then
``unshard`` of the TP-local tensors, cut to ``real_rows``.

Files are opened with ``torch.load(weights_only=True, mmap=True)``: only the bytes of the
tensors actually touched are read.  Tied embeddings: ``output_layer.weight`` is an alias of
``embedding.word_embeddings.weight`` (the last stage's copy is kept equal by training).
"""

from __future__ import annotations

import torch

from megazero.checkpoint import files as ckpt
from megazero.model.config import ARG_KEYS, GPTConfig
from megazero.tensor_parallel.spec import unshard

WORD_EMBEDDING = "embedding.word_embeddings.weight"
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")
MODEL_KEYS = ARG_KEYS + ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


class CheckpointReader:
    """``CheckpointReader(load_dir, iteration=None)``: the latest iteration unless given.

    Attributes: ``metadata`` (metadata.json), ``args`` (the saving run's arguments, a dict),
    ``iteration``, ``layout``, ``directory``.  Raises :class:`CheckpointError` naming the file
    when a file is missing, truncated, or holds anything but tensors and plain values.
    """

    def __init__(self, load_dir: str, iteration: int | None = None):
        if iteration is None:
            iteration = ckpt.latest_iteration(load_dir)
            if iteration is None:
                raise ckpt.CheckpointError(f"{load_dir}: no {ckpt.LATEST} (no checkpoint saved there)")
        self.root, self.iteration = load_dir, int(iteration)
        self.directory = ckpt.iteration_dir(load_dir, self.iteration)
        self.metadata = ckpt.read_metadata(load_dir, self.iteration)
        self.args = dict(self.metadata.get("args", {}))
        self.layout = self.metadata.get("layout", {})
        if "index" not in self.metadata:
            raise ckpt.CheckpointError(f"{self.directory}/metadata.json has no index (saved by a megazero "
                                       "without resharding support): load it in its own layout")
        self.ranks = self.metadata["index"]["ranks"]
        self.tp = int(self.layout["tensor_model_parallel_size"])
        self.tied = not self.args.get("untie_embeddings_and_output_weights", False)
        self.has_optimizer = not self.args.get("no_save_optim", False)
        self._files: dict[int, dict] = {}
        self._where: dict[str, list] = {}     # name -> [(tp_rank, dp_rank, rank, chunk, local_shape, split)]
        self._regions: dict[str, list] = {}   # name -> [(tp_rank, dp_rank, rank, region, offset, numel, lo, len)]
        self._order: list[tuple] = []         # (virtual stage, position, name) on TP rank 0, DP rank 0
        pp = int(self.layout["pipeline_model_parallel_size"])
        for e in self.ranks:
            t, d, r = e["tp_rank"], e["dp_rank"], e["rank"]
            for pos, (chunk, name, shape, split) in enumerate(e["params"]):
                self._where.setdefault(name, []).append((t, d, r, chunk, tuple(shape), split))
                if t == 0 and d == 0:
                    self._order.append((chunk * pp + e["pp_rank"], pos, name))
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
            self._files[rank] = ckpt.load_rank_state(self.root, self.iteration, rank, mmap=True)
        return self._files[rank]

    def close(self) -> None:
        self._files.clear()

    def rank_index(self, rank: int) -> dict:
        return self.ranks[rank]

    # ---- description -------------------------------------------------------------------------
    def model_config_args(self) -> dict:
        """The saved model-shape and tokenizer arguments (``padded_vocab_size`` is the saving TP's)."""
        return {k: self.args.get(k) for k in MODEL_KEYS}

    def gpt_config(self, **overrides):
        """A :class:`GPTConfig` of the saved model; ``padded_vocab_size`` None (re-padded per TP)."""
        return GPTConfig.from_saved_args(self.args, **overrides)

    def param_names(self) -> list[str]:
        """Every parameter once, in model order (embedding, layers, final norm, head); with tied
        embeddings ``output_layer.weight`` (the last stage's copy) is left out."""
        names = []
        for _, _, name in sorted(self._order):
            if name not in names and not (self.tied and name == "output_layer.weight" and WORD_EMBEDDING in self._where):
                names.append(name)
        return names

    # ---- tensors -----------------------------------------------------------------------------
    def _resolve(self, name: str) -> str:
        if name not in self._where and name == "output_layer.weight" and self.tied and WORD_EMBEDDING in self._where:
            return WORD_EMBEDDING
        if name not in self._where:
            raise KeyError(f"{self.directory}: no parameter {name!r} in this checkpoint")
        return name

    def _local(self, name: str, kind: str, tp_rank: int, shape: tuple) -> torch.Tensor:
        """The TP-local tensor of ``name`` on ``tp_rank`` (weight: saved dtype; else fp32)."""
        if kind == "weight" or (kind == "master" and not self.has_optimizer):
            t, d, rank, chunk, _, _ = next(w for w in self._where[name] if w[0] == tp_rank)
            path = ckpt.rank_file(self.directory, rank)
            try:
                w = self.rank_state(rank)["model"][chunk][name]
            except (KeyError, IndexError, TypeError):
                raise ckpt.CheckpointError(f"{path}: model chunk {chunk} lacks {name!r}") from None
            return w if kind == "weight" else w.float()
        if not self.has_optimizer:
            raise ckpt.CheckpointError(f"{self.directory} was saved with --no-save-optim: no {kind}")
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
                shard = self.rank_state(rank)["optimizer"]["shards"][ri][kind]
            except (KeyError, IndexError, TypeError):
                raise ckpt.CheckpointError(f"{ckpt.rank_file(self.directory, rank)}: no optimizer region {ri}") from None
            flat[a - o:b - o] = shard[a - lo:b - lo]
            done += b - a
        if done != numel:
            raise ckpt.CheckpointError(f"{self.directory}: the optimizer shards of {name!r} cover {done} of "
                                       f"{numel} elements")
        return flat.view(shape)

    def full_param(self, name: str, kind: str = "weight") -> torch.Tensor:
        """The full, unpadded tensor of ``name``: ``weight`` in the saved dtype, ``master``,
        ``exp_avg`` or ``exp_avg_sq`` in fp32 (vocabulary matrices: ``vocab_size`` rows)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} not in {KINDS}")
        name = self._resolve(name)
        where = self._where[name]
        split, shape = where[0][5], where[0][4]
        if split is None:
            return self._local(name, kind, 0, shape).clone()
        dim, sizes, real_rows = split
        pieces = [self._local(name, kind, t, shape) for t in range(self.tp)]
        full = unshard(pieces, dim, sizes)
        return (full[:real_rows] if real_rows is not None else full).clone()

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
        opt = self.rank_state(0).get("optimizer")
        return None if opt is None else {k: v for k, v in opt.items() if k != "shards"}
