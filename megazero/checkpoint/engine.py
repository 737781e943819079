"""The engine's checkpoints: sharded as trained, loadable at another DP size or ZeRO stage, and
consolidated into one fp32 state dict (what DeepSpeed users get from ``zero_to_fp32.py``).

Layout of ``{dir}/{tag}/`` (``{dir}/latest`` holds the last tag, as DeepSpeed writes it)::

    engine_meta.json        rank 0: DP size, stage, engine counters, parameter names/shapes, aliases
                            (``micro_steps`` is written but not read back: :func:`resumed_micro_steps`)
    zero_rank_{r:05d}.pt    rank r: its regions' layout ([name, offset, numel], padded, shard_lo,
                            shard_len) and its fp32 master / exp_avg / exp_avg_sq shards, the
                            ZeRO counters and loss scaler
    module_buffers.pt       rank 0: the module's persistent buffers (state_dict minus parameters)
    client_state.pt         rank 0: LR scheduler state and the caller's ``client_state``

Saving is crash-safe as the trainer's (:mod:`megazero.checkpoint.files`): every rank writes into
``{dir}/{tag}.tmp/`` (each file through a ``.partial`` name), the ranks agree that every file was
written, and only then does rank 0 write ``engine_meta.json``, publish the folder as ``{tag}/``
(an existing one swapped out after) and rewrite ``latest``. A failed or killed save leaves the
previous checkpoint and ``latest`` as they were, and raises :class:`CheckpointError` on every rank
naming the rank, the file and the cause.

Versioning: ``engine_meta.json``'s ``format`` is ``megazero-engine-N`` (:data:`VERSION`); versions
in :data:`READABLE_VERSIONS` load, a newer one is refused by its number instead of misread.

Nothing is gathered to save: each rank writes what it owns (at stage 3 the masters are the
parameters' only full-precision copy). Loading maps every parameter element to the saved shard
that holds it (each parameter is ``[offset, offset + numel)`` of its region; a rank's shard is
``[shard_lo, shard_lo + shard_len)``), so a rank reads only the overlap of the saved pieces with
its own shard (files opened with ``mmap``), whatever DP size, bucket sizes or units saved them.
Everything loads with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megazero.checkpoint import reshard
from megazero.checkpoint.files import agree_on_writes, atomic_write_text, read_file, replace_folder, write_file

FORMAT_NAME = "megazero-engine"
VERSION = 1
READABLE_VERSIONS = (1,)
FORMAT = f"{FORMAT_NAME}-{VERSION}"
KINDS = ("master", "exp_avg", "exp_avg_sq")
META = "engine_meta.json"


def _rank_file(folder: str, r: int) -> str:
    return os.path.join(folder, f"zero_rank_{r:05d}.pt")


def names(module) -> tuple[dict, dict]:
    """(id(param) -> canonical name, alias name -> canonical name) of the module's parameters."""
    name_of, aliases = {}, {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in name_of:
            aliases[n] = name_of[id(p)]
        else:
            name_of[id(p)] = n
    return name_of, aliases


def persistent_buffers(module) -> dict:
    """The buffers ``module.state_dict()`` would hold (each tensor once), cloned to the CPU, without
    calling it (at stage 3 that gathers every unit, a collective): the trainer's own walk,
    :func:`megazero.checkpoint.reshard.persistent_buffers`, over the one module."""
    return {name: buf.detach().cpu().clone() for _, name, buf in reshard.persistent_buffers([module])}


def _meta(engine, aliases: dict) -> dict:
    return {"format": FORMAT, "dp": engine.topo.dp, "stage": engine.config.stage,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "global_samples": engine.global_samples,
            "params": {n: list(p.shape) for n, p in engine.module.named_parameters()}, "aliases": aliases}


def save(engine, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Write this rank's part (collective: every rank calls it), crash-safe (module doc).
    Returns the folder."""
    final = os.path.join(save_dir, str(tag))
    tmp, rank = final + ".tmp", engine.topo.rank
    zero, module = engine.zero, engine.module
    zero.wait_params()
    name_of, aliases = names(module)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    error = write_file({"layout": zero.layout(name_of), "shards": [r.shard_state(copy=False) for r in zero.regions],
                        "counters": zero.state_dict(shards=False)}, _rank_file(tmp, rank), tmp)
    if rank == 0 and error is None:
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        error = (write_file(persistent_buffers(module), os.path.join(tmp, "module_buffers.pt"), tmp)
                 or write_file({"lr_scheduler": sched, "client_state": client_state or {}},
                               os.path.join(tmp, "client_state.pt"), tmp))
    agree_on_writes(error, rank, tmp, f"engine.save_checkpoint {final}",
                    f"{os.path.join(save_dir, 'latest')} and any earlier {final} are as they were")
    if rank == 0:
        atomic_write_text(os.path.join(tmp, META), json.dumps(_meta(engine, aliases), indent=1))
        replace_folder(tmp, final)
        atomic_write_text(os.path.join(save_dir, "latest"), str(tag))
    dist.barrier()
    return final


def _version(fmt) -> int | None:
    name, _, number = str(fmt).rpartition("-")
    return int(number) if name == FORMAT_NAME and number.isdigit() else None


def resolve(load_dir: str, tag: str | None) -> tuple[str, dict]:
    """(the checkpoint folder, its metadata); ``tag`` None: the one named in ``latest``."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"engine.load_checkpoint: no tag given and no {latest}")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(load_dir, str(tag))
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"engine.load_checkpoint: {path} not found (not a megazero engine checkpoint)")
    with open(path) as f:
        meta = json.load(f)
    version = _version(meta.get("format"))
    if version is None:
        raise ValueError(f"engine.load_checkpoint: {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"engine.load_checkpoint: {path} is engine format version {version}; this megazero reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}: load it with the release that wrote it")
    return folder, meta


def _load(path: str, mmap: bool = False):
    """One file of an engine checkpoint (:func:`megazero.checkpoint.files.read_file`)."""
    return read_file(path, mmap=mmap, who="engine.load_checkpoint")


class ShardPieces:
    """Saved flat shards read by element ranges: ``files[r]["shards"][k][kind]`` is rank ``r``'s
    shard ``k`` of ``kind`` (``master``, ``exp_avg``, ``exp_avg_sq``); ``pieces[name]`` =
    ``[(a, b, rank, k, lo)]``: elements ``[a, b)`` of parameter ``name`` are elements
    ``[lo, lo + b - a)`` of that shard. Filled by :class:`SavedShards` (this format) and by
    :mod:`megazero.checkpoint.deepspeed_files` (DeepSpeed's partitions)."""

    def __init__(self, files: list, pieces: dict):
        self.files, self.pieces = files, pieces

    def read(self, name: str, kind: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the flattened saved ``kind`` of parameter ``name``."""
        out = torch.empty(b - a, dtype=torch.float32)
        filled = 0
        for pa, pb, r, k, lo in self.pieces.get(name, []):
            x, y = max(a, pa), min(b, pb)
            if x < y:
                out[x - a:y - a] = self.files[r]["shards"][k][kind][lo + x - pa:lo + y - pa]
                filled += y - x
        if filled != b - a:
            raise ValueError(f"engine.load_checkpoint: the checkpoint lacks elements of parameter {name!r}")
        return out

    def full(self, name: str, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return self.read(name, "master", 0, n).view(shape)


class SavedShards(ShardPieces):
    """Every saved rank's shards, opened with ``mmap`` (:class:`ShardPieces`, ``k`` the region).
    ZeRO stage 0 keeps no shards: every DP rank's file holds the whole replicated state, so only
    rank 0's is read (reading all would count each element DP times)."""

    def __init__(self, folder: str, meta: dict):
        ranks = 1 if meta["stage"] == 0 else meta["dp"]
        super().__init__([_load(_rank_file(folder, r), mmap=True) for r in range(ranks)], {})
        for r, saved in enumerate(self.files):
            for k, region in enumerate(saved["layout"]):
                lo, hi = region["shard_lo"], region["shard_lo"] + region["shard_len"]
                for name, o, n in region["params"]:
                    a, b = max(o, lo), min(o + n, hi)
                    if a < b:
                        self.pieces.setdefault(name, []).append((a - o, b - o, r, k, a - lo))


def load(engine, load_dir: str, tag: str | None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True):
    """Fill the engine from a checkpoint saved at any DP size / stage (collective). Returns
    ``(folder, client_state)`` as DeepSpeed's ``load_checkpoint`` does."""
    folder, meta = resolve(load_dir, tag)
    zero, module = engine.zero, engine.module
    name_of, _ = names(module)
    mine = {n: list(p.shape) for n, p in module.named_parameters()}
    if mine != meta["params"]:
        diff = next((n for n in sorted(set(mine) | set(meta["params"])) if mine.get(n) != meta["params"].get(n)), "?")
        raise ValueError(f"engine.load_checkpoint: {folder} holds another model (parameter {diff!r}: saved "
                         f"{meta['params'].get(diff)}, here {mine.get(diff)})")
    saved = SavedShards(folder, meta)
    kinds = KINDS if load_optimizer_states else ("weight",)

    def fetch(p, kind, a, b):
        return saved.read(name_of[id(p)], "master" if kind == "weight" else kind, a, b)
    zero.load_param_ranges(fetch, kinds)
    if load_optimizer_states:
        zero.load_counters(saved.files[0]["counters"])
    buffers = _load(os.path.join(folder, "module_buffers.pt"))
    with torch.no_grad():  # set in place: a module load_state_dict would re-read (round) the masters
        for key, value in buffers.items():
            module.get_buffer(key).copy_(value)
    extra = _load(os.path.join(folder, "client_state.pt"))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    for key in ("global_steps", "skipped_steps", "global_samples"):
        setattr(engine, key, meta[key])
    engine.micro_steps = resumed_micro_steps(meta["global_steps"], engine.gradient_accumulation_steps())
    return folder, extra["client_state"]


def resumed_micro_steps(global_steps: int, gas: int) -> int:
    """The engine's micro-step counter after a load: ``global_steps * gas`` with this run's ``gas``.

    The boundary test is ``(micro_steps + 1) % gas == 0``, so the first optimizer step after the
    load comes after ``gas`` micro-batches, as at every step of a run that had used this ``gas``
    from the start. The saved ``micro_steps`` (``global_steps * gas_saved`` at a step boundary) is
    not used: at another GAS it would put the boundary after ``gas - (micro_steps_saved % gas)``
    micro-batches (issue 41: saved at GAS 2 after 3 steps, 6 % 4 = 2, a step after 2 micro-batches
    at GAS 4). DeepSpeed 0.19.8 (deepspeed/runtime/engine.py, ``_load_checkpoint``) neither saves
    nor restores ``micro_steps``, so a fresh engine counts its boundary from the load with the
    same result; here the counter also keeps ``micro_steps == global_steps * gas``. Gradients are
    not saved, so a checkpoint is always resumed at a step boundary."""
    return global_steps * gas


def consolidated_state_dict(load_dir: str, tag: str | None = None) -> dict:
    """One fp32 ``state_dict`` (parameters from the masters under every name, tied aliases
    included, and the buffers) of a checkpoint, on the CPU, in one process: ``zero_to_fp32``."""
    folder, meta = resolve(load_dir, tag)
    saved = SavedShards(folder, meta)
    out = {name: saved.full(name, shape).clone() for name, shape in meta["params"].items()}
    for alias, name in meta["aliases"].items():
        out[alias] = out[name]
    out.update(_load(os.path.join(folder, "module_buffers.pt")))
    return out
