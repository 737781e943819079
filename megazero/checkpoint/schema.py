"""The on-disk checkpoint format: the one place that names its paths, keys and version.

Format version 4 (:data:`VERSION`; versions 1-3 still read)::

    DIR/latest_checkpointed_iteration.txt      "100\\n" -- the pointer, written last, atomically
    DIR/iter_0000100/metadata.json             {"iteration", "consumed_samples", "layout", "args", "index"}
    DIR/iter_0000100/rank_00005.pt             what rank 5 owns (torch.save; tensors and plain values)

A rank file (:func:`rank_state`) holds ``model`` (one dict per VP chunk, global names, TP-local
tensors in ``params_dtype``: only the parameters whose index entry says ``"model"``),
``param_shards`` (ZeRO-3: per region this rank's ``[lo, lo + n)`` of the flat parameters in
``params_dtype``, ``None`` for a region kept whole), ``scheduler``, ``counters``
(``{"skipped", "nans"}``), optionally ``rng`` (:mod:`megazero.checkpoint.rng`) and ``optimizer``
(``iteration``, ``scaler``, skip counters, and ``shards``: per ZeRO region ``{master, exp_avg,
exp_avg_sq}``, fp32, this DP rank's shard -- ``[]`` on DP ranks > 0 at ZeRO 0, whose replicas
are DP rank 0's).

**Written once** (version 3): a weight kept whole (ZeRO 0-2; ZeRO-3's small persistent and tied
parameters) is written by DP rank 0 of its (TP, PP) position only; a ZeRO-3 unit's weights only
as the DP ranks' parameter shards; the fp32 state by the rank that owns its shard. So a
checkpoint holds ~one copy of the model states (weights 2Φ + master and moments 12Φ in bf16),
whatever the DP size, and no rank gathers anything to write it. (Versions 1-2: every rank wrote
its full TP-local weights, ZeRO-3 gathered.)

``metadata.json``: ``layout`` (:data:`LAYOUT_KEYS`), ``args`` (the saving run's arguments, JSON
values only, with the model's under Megatron names), and ``index``::

    {"version": 4, "aliases": {copy name: canonical name},
     "ranks": [{"rank": r, "tp_rank": t, "pp_rank": p, "dp_rank": d,
                "ep_rank": e, "etp_rank": et, "edp_rank": ed,            # version 4, ranks holding experts
                "params":  [[chunk, name, local_shape, split, stored(, "expert")], ...],
                "buffers": [[chunk, name, shape, null, stored], ...],    # version 4, when there are any
                "regions": [{"params": [[name, offset, numel], ...], "padded": P,
                             "shard_lo": lo, "shard_len": n, "partitioned": bool}, ...]}, ...]}

``split`` is :meth:`TPSplit.to_json` (``[dim, partition_sizes, real_rows]``) or ``null`` for a
parameter replicated over TP (:mod:`megazero.tensor_parallel.spec`). ``stored``: where this
file holds the weight -- ``"model"`` (``file["model"][chunk][name]``), ``"shard"`` (its region's
``param_shards`` over the DP ranks, like the master) or ``null`` (another DP replica's file;
version 1-2 entries have no ``stored``: ``"model"``). A ZeRO region is a flat buffer of the
listed parameters; ``name`` occupies ``[offset, offset + numel)``, the buffer is padded to ``P``
and DP rank ``d`` holds ``[lo, lo + n)`` of it. ``aliases`` names parameters that are copies of
another (tied embeddings): a reader gives the canonical tensor for a copy no rank saved. A
version-1 index has no ``aliases``; every version-1 checkpoint is a GPT, whose tie
(:data:`FORMAT1_ALIASES`) applies unless its args say ``untie_embeddings_and_output_weights``.

**Version 4: the expert grid and buffers.** A routed expert's weight (``"expert"`` after
``stored``) lives on the expert grid (:mod:`megazero.parallel.topology`): only its EP rank
holds it, it is split over expert TP (its piece is that of the entry's ``etp_rank``, of
``expert_tensor_parallel_size`` pieces), kept whole by expert-DP rank 0 (``edp_rank``), and its
ZeRO region is sharded over the expert-DP ranks (``shard_lo`` counts in that group); at ZeRO 0
the fp32 state of a region is written by DP rank 0 of its grid (expert-DP rank 0 for experts),
the other ranks' ``shards`` lists hold ``None`` there. ``buffers`` are persistent module
buffers that are training state without optimizer state (the MoE router's fp32
``expert_bias``), written with the weights (``model``) by DP rank 0, replicated over TP. The
layout gains ``expert_model_parallel_size`` and ``expert_tensor_parallel_size`` (absent in
older files: 1 and TP). A checkpoint whose index needs none of this (a dense model) is written
as version 3, so older readers keep reading it; an MoE checkpoint is version 4, which older
readers refuse by version instead of misreading. A version 1-3 checkpoint of an MoE model
(saved before the expert grid was recorded, with experts of EP ranks > 0 unsaved) is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megazero.tensor_parallel.spec import TPSplit

VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
DENSE_VERSION = 3  # what an index without expert-grid entries or buffers is written as

LATEST = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT = "format"  # metadata.json key: "torch_dcp" in a DCP folder (megazero/checkpoint/dcp.py); absent in this format
TORCH_DCP = "torch_dcp"

# rank-file keys
MODEL, RNG, SCHEDULER, COUNTERS, OPTIMIZER = "model", "rng", "scheduler", "counters", "optimizer"
SHARDS = "shards"  # inside OPTIMIZER: per ZeRO region {kind: this DP rank's flat fp32 shard}
PARAM_SHARDS = "param_shards"  # ZeRO-3: per region this DP rank's flat parameter shard (or None)
STORED_MODEL, STORED_SHARD = "model", "shard"  # where a file holds a weight (ParamEntry.stored)
EXPERT = "expert"  # a parameter entry's grid marker: a routed expert's weight (version 4)
COUNTER_KEYS = ("skipped", "nans")
# metadata keys
ITERATION, CONSUMED_SAMPLES, LAYOUT, ARGS, INDEX = "iteration", "consumed_samples", "layout", "args", "index"
LAYOUT_KEYS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "data_parallel_size", "zero_stage", "params_dtype",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size")
FORMAT1_ALIASES = {"output_layer.weight": "embedding.word_embeddings.weight"}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit this run; the message names the file."""


# ---- paths -----------------------------------------------------------------------------------
def latest_file(root: str) -> str:
    return os.path.join(root, LATEST)


ITERATION_PREFIX = "iter_"  # iter_0000100/: Megatron's folder name, 7 digits


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"{ITERATION_PREFIX}{iteration:07d}")


def iteration_glob(root: str, suffix: str = "") -> str:
    """The glob pattern of ``root``'s iteration folders (``suffix`` ``.tmp``: those being written,
    ``.old``: those being replaced)."""
    return os.path.join(root, f"{ITERATION_PREFIX}*{suffix}")


def saved_iterations(root: str) -> list[int]:
    """The iterations ``root`` holds a published folder for, ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    digits = [n[len(ITERATION_PREFIX):] for n in names if n.startswith(ITERATION_PREFIX)]
    return sorted(int(d) for d in digits if d.isdigit())


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def metadata_file(directory: str) -> str:
    return os.path.join(directory, METADATA)


# ---- rank files ------------------------------------------------------------------------------
def rank_state(model: list[dict], scheduler: dict | None, counters: dict, rng: dict | None = None,
               optimizer: dict | None = None, param_shards: list | None = None) -> dict:
    """One rank file's contents; ``rng`` / ``optimizer`` / ``param_shards`` left out when None."""
    state = {MODEL: model}
    if param_shards is not None:
        state[PARAM_SHARDS] = param_shards
    if rng is not None:
        state[RNG] = rng
    state[SCHEDULER] = scheduler
    state[COUNTERS] = {k: int(counters[k]) for k in COUNTER_KEYS}
    if optimizer is not None:
        state[OPTIMIZER] = optimizer
    return state


# ---- metadata --------------------------------------------------------------------------------
def _dtype_name(value) -> str:
    return str(value).replace("torch.", "")


def layout(world_size: int, tp: int, pp: int, vp: int | None, dp: int, zero_stage: int, params_dtype,
           ep: int = 1, etp: int | None = None, cp: int = 1) -> dict:
    """The parallel layout record (``vp`` None when not interleaved; dtype by name; ``etp``
    None: TP). CP shards no parameter, but ZeRO partitions over DP x CP, so a CP change reshards."""
    return {"world_size": world_size, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vp, "data_parallel_size": dp, "zero_stage": zero_stage,
            "params_dtype": _dtype_name(params_dtype), "expert_model_parallel_size": int(ep),
            "expert_tensor_parallel_size": int(tp if etp is None else etp), "context_parallel_size": int(cp)}


def layout_value(record: dict, key: str):
    """``record[key]``; for a record saved before the key existed, its value then: EP 1, CP 1, ETP = TP."""
    if key in record:
        return record[key]
    if key in ("expert_model_parallel_size", "context_parallel_size"):
        return 1
    if key == "expert_tensor_parallel_size":
        return record.get("tensor_model_parallel_size")
    return None


def layout_diffs(saved: dict, current: dict) -> list[str]:
    """``"key saved X vs now Y"`` for every layout key that differs."""
    values = [(k, layout_value(saved, k), layout_value(current, k)) for k in LAYOUT_KEYS]
    return [f"{k} saved {a} vs now {b}" for k, a, b in values if a != b]


def metadata(iteration: int, consumed_samples: int, layout: dict, args: dict, index: dict, **extra) -> dict:
    """``metadata.json``'s contents; ``extra`` keys (e.g. ``imported_from``) are kept as given."""
    return {ITERATION: int(iteration), CONSUMED_SAMPLES: int(consumed_samples), LAYOUT: dict(layout),
            ARGS: dict(args), INDEX: index, **extra}


# ---- index -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamEntry:
    """One parameter of a rank file: ``file[MODEL][chunk][name]``, of TP-local ``shape``
    (``expert``: a routed expert's, split over expert TP, replicated over expert DP)."""

    chunk: int
    name: str
    shape: tuple[int, ...]
    split: TPSplit | None
    stored: str | None = STORED_MODEL
    expert: bool = False

    def to_json(self) -> list:
        out = [int(self.chunk), self.name, [int(s) for s in self.shape],
               None if self.split is None else self.split.to_json(), self.stored]
        return out + [EXPERT] if self.expert else out

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def from_json(cls, obj) -> "ParamEntry":
        chunk, name, shape, split = obj[:4]
        stored = obj[4] if len(obj) > 4 else STORED_MODEL  # versions 1-2: every file has its weights
        return cls(int(chunk), name, tuple(int(s) for s in shape), TPSplit.from_json(split), stored,
                   len(obj) > 5 and obj[5] == EXPERT)


def index_entry(rank: int, tp_rank: int, pp_rank: int, dp_rank: int, params: list[ParamEntry],
                regions: list[dict], expert: tuple[int, int, int] | None = None,
                buffers: list[ParamEntry] = ()) -> dict:
    """One rank's entry of the index (JSON values; equal to itself after a JSON round trip);
    ``expert``: the rank's ``(ep_rank, etp_rank, edp_rank)`` when it holds routed experts."""
    entry = {"rank": int(rank), "tp_rank": int(tp_rank), "pp_rank": int(pp_rank), "dp_rank": int(dp_rank)}
    if expert is not None:
        entry.update(zip(("ep_rank", "etp_rank", "edp_rank"), (int(v) for v in expert)))
    entry["params"] = [p.to_json() for p in params]
    if buffers:
        entry["buffers"] = [b.to_json() for b in buffers]
    entry["regions"] = regions
    return entry


def entry_version(entry: dict) -> int:
    """The oldest format version that can hold ``entry``: 4 with experts or buffers, else 3."""
    v4 = "ep_rank" in entry or "buffers" in entry or any(len(p) > 5 for p in entry["params"])
    return VERSION if v4 else DENSE_VERSION


def make_index(ranks: list[dict], aliases: dict[str, str]) -> dict:
    """The index of every rank's entry (rank order), of the oldest version that holds them all
    (a dense model's stays readable by version-3 readers)."""
    version = max([DENSE_VERSION] + [entry_version(e) for e in ranks])
    return {"version": version, "aliases": dict(sorted(aliases.items())), "ranks": list(ranks)}


def read_index(meta: dict, where: str) -> tuple[list[dict], dict[str, str]]:
    """``(ranks, aliases)`` of ``meta``'s index, any readable version; ``where`` names the file."""
    if INDEX not in meta:
        raise CheckpointError(f"{where} has no index (saved by a megazero without resharding support): "
                              "load it in its own layout")
    index = meta[INDEX]
    version = index.get("version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{where}: checkpoint format version {version} is not one this megazero reads "
                              f"({READABLE_VERSIONS})")
    if version < 4 and meta.get(ARGS, {}).get("num_experts"):
        raise CheckpointError(f"{where}: an MoE checkpoint of format version {version}, saved before the expert "
                              "grid was recorded (routed experts of EP ranks > 0 and the expert bias were not "
                              "written); it cannot be loaded")
    if version == 1:
        tied = not meta.get(ARGS, {}).get("untie_embeddings_and_output_weights", False)
        return index["ranks"], dict(FORMAT1_ALIASES) if tied else {}
    return index["ranks"], dict(index["aliases"])


def comparable_entry(entry: dict, version: int) -> dict:
    """``entry`` (this format) as a version-``version`` index would hold it: versions 1-2 had no
    ``stored`` per parameter and no ``partitioned`` per region."""
    if version >= 3:
        return entry
    return dict(entry, params=[p[:4] for p in entry["params"]],
                regions=[{k: v for k, v in r.items() if k != "partitioned"} for r in entry["regions"]])


def index_version(meta: dict) -> int:
    """The index's format version (0: no index)."""
    return int(meta[INDEX].get("version", 0)) if INDEX in meta else 0


def entry_params(entry: dict) -> list[ParamEntry]:
    """The :class:`ParamEntry` list of one rank's index entry."""
    return [ParamEntry.from_json(p) for p in entry["params"]]


def entry_buffers(entry: dict) -> list[ParamEntry]:
    """The persistent buffers of one rank's index entry (version 4; none before)."""
    return [ParamEntry.from_json(b) for b in entry.get("buffers", ())]


def grid_ranks(entry: dict, expert: bool) -> tuple[int, int]:
    """``(tp_rank, dp_rank)`` of a rank entry on the grid of a parameter: the expert grid's
    ``(etp_rank, edp_rank)`` for a routed expert's, else the dense ``(tp_rank, dp_rank)``."""
    return (entry["etp_rank"], entry["edp_rank"]) if expert else (entry["tp_rank"], entry["dp_rank"])
