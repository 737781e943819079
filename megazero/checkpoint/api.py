"""Save and load a training run: what ``Trainer.save`` / ``Trainer.load`` call.

:func:`save_run` / :func:`start_save` (collective): every rank writes its own file
(:func:`schema.rank_state`: what it alone owns -- ZeRO-3 parameter shards, weights kept whole
on DP rank 0 only, its optimizer shard, LR scheduler, counters, RNG; nothing gathered); rank 0
gathers every rank's index entry (:func:`reshard.rank_index`) and writes ``metadata.json`` with
the layout, the saved arguments and the model's aliases, so that any layout can load it.
``start_save(..., writer=AsyncWriter())`` hands the write to the rank's writer process (``--async-save``).

:func:`load_run` (collective) reads the pointer and takes one of two paths, the same on every rank:

* **exact**: the layout is equal and this rank's index entry equals what it would save now (or the
  checkpoint has no index, which is then refused in another layout): this rank's file as saved,
  RNG states included -- resume is bit-exact;
* **resharded** (:mod:`megazero.checkpoint.reshard`): each parameter's full tensor from the files
  that hold it, sliced for this rank's TP / PP / ZeRO shard; RNG states are not restored (this
  run's ``--seed`` streams are used).

The scheduler state, counters, iteration and consumed samples come back in :class:`Loaded` for the
caller to apply (``finetune``: weights only, the run starts at iteration 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.checkpoint import files, schema
from megazero.checkpoint.async_writer import AsyncWriter
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.reshard import (check_model_shape, load_buffers, load_resharded, named_parameters,
                                         persistent_buffers, rank_index, same_layout)
from megazero.checkpoint.rng import restore_rng, rng_state
from megazero.checkpoint.schema import CheckpointError


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_run` read: ``path`` ``"exact"`` or ``"resharded"``; ``scheduler`` /
    ``counters`` None when there is nothing to restore (``finetune``, or an imported checkpoint)."""

    path: str
    iteration: int
    consumed_samples: int
    scheduler: dict | None
    counters: dict | None
    bytes_read: int = 0  # tensor bytes this rank read from the checkpoint's files


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _print0(text: str) -> None:
    if _rank() == 0:
        print(text, flush=True)


def _host(obj):
    """``obj`` with every tensor on the CPU: one copy from an accelerator, the live tensor on the
    CPU (a synchronous save writes it, an asynchronous one copies it, before the next step)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host(v) for v in obj)
    return obj


def _snapshot(topo, stages, optimizer, index: dict, scheduler_state, counters: dict, save_optim: bool,
              save_rng: bool) -> dict:
    """This rank's file: what it alone writes (schema, "Written once"), on the host, without a
    copy of what already is (no extra memory)."""
    whole = {p[1] for p in index["params"] + index.get("buffers", []) if p[4] == schema.STORED_MODEL}
    model = [{} for _ in stages.chunks]
    tensors = [(c, name, p) for c, name, _, _, p, _ in named_parameters(stages.chunks)]
    for c, name, t in tensors + list(persistent_buffers(stages.chunks)):
        if name in whole:
            model[c][name] = t.detach().to("cpu")
    shards = [r["partitioned"] for r in index["regions"]]
    optimizer_state = _host(_optimizer_state(topo, optimizer)) if save_optim else None
    return schema.rank_state(model, scheduler_state, counters, rng=rng_state(stages.rng_states) if save_rng else None,
                             optimizer=optimizer_state,
                             param_shards=_host(optimizer.param_shards(copy=False)) if any(shards) else None)


def _optimizer_state(topo, optimizer) -> dict:
    """The optimizer's counters and the fp32 shards this rank writes: all of them at ZeRO >= 1;
    at ZeRO 0 the regions whose grid has this rank as DP rank 0 (expert-DP rank 0 for routed
    experts' regions), ``None`` for the others, ``[]`` when it writes none (every replica is
    another file's)."""
    state = optimizer.state_dict(shards=True, copy=False)
    if optimizer.stage == 0:
        mine = [(topo.edp_rank if r.group == "edp" else topo.dp_cp_rank) == 0 for r in optimizer.regions]
        state["shards"] = [s if m else None for s, m in zip(state["shards"], mine)] if any(mine) else []
    return state


def start_save(root: str, *, topo, stages, optimizer, scheduler_state: dict | None, counters: dict, iteration: int,
               consumed_samples: int, layout: dict, saved_args: dict, save_optim: bool = True,
               save_rng: bool = True, writer: AsyncWriter | None = None) -> files.PendingSave:
    """Begin saving checkpoint ``iteration`` under ``root`` (collective): snapshot this rank's
    part to host memory (copies only from an accelerator), gather the index to rank 0, and write
    the rank file -- or, given a ``writer`` (``--async-save``), copy it into the writer's shared
    buffer and let its process write it (:class:`~.async_writer.AsyncWriter`). Call ``.finish()``
    (collective) to publish.

    ``stages``: a :class:`~megazero.model.stages.ModelStages` (``chunks``, ``rng_states``,
    ``aliases``); ``counters``: ``{"skipped", "nans"}``; ``layout``: :func:`schema.layout`;
    ``saved_args``: JSON values recorded as the run's arguments (with the model's keys).
    Nothing is gathered but the index: ZeRO-3 writes its shards as they are."""
    index = rank_index(topo, stages.chunks, optimizer)
    state = _snapshot(topo, stages, optimizer, index, scheduler_state, counters, save_optim, save_rng)
    rank = _rank()
    if dist.is_initialized():
        indices = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(index, indices, dst=0)
    else:
        indices = [index]
    meta = schema.metadata(iteration, consumed_samples, layout, saved_args,
                           schema.make_index(indices or [], stages.aliases)) if rank == 0 else {}
    return files.PendingSave(root, iteration, rank, state, meta).start(writer)


def reserve_save(writer: AsyncWriter, *, topo, stages, optimizer, scheduler_state: dict | None, counters: dict,
                 save_optim: bool = True, save_rng: bool = True) -> None:
    """Have ``writer`` start and allocate (and fault in) the shared buffer that
    :func:`start_save` with the same arguments will copy this rank's state into
    (:meth:`~.async_writer.AsyncWriter.reserve`); not collective, nothing written."""
    index = rank_index(topo, stages.chunks, optimizer)
    writer.reserve(_snapshot(topo, stages, optimizer, index, scheduler_state, counters, save_optim, save_rng))


def save_run(root: str, **kwargs) -> str:
    """Save checkpoint ``iteration`` under ``root`` and publish it; returns its folder. Collective.
    Keywords: those of :func:`start_save` (without ``writer``)."""
    return start_save(root, **kwargs).finish()


def _choose_path(root: str, iteration: int, meta: dict, *, topo, stages, optimizer, layout, model_config,
                 device) -> tuple[bool, CheckpointReader | None]:
    """(exact?, reader or None): the same answer on every rank."""
    directory = schema.iteration_dir(root, iteration)
    if schema.INDEX not in meta:  # saved before resharding existed: same layout only
        files.check_layout(meta[schema.LAYOUT], layout, directory)
        return True, None
    reader = CheckpointReader(root, iteration)
    if model_config is not None:
        check_model_shape(reader, model_config)
    exact = same_layout(reader, layout, rank_index(topo, stages.chunks, optimizer))
    if dist.is_initialized():
        flags = torch.tensor([int(exact)], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank takes the same path
        exact = bool(flags.item())
    return exact, reader


def _load_exact(root: str, iteration: int, stages, optimizer, load_optim: bool, reader) -> dict:
    """This rank's file as saved into the chunks (and optimizer); returns the file's contents.

    Format 3: the fp32 state from this rank's file (ZeRO 0, DP rank > 0: DP rank 0's) and the
    weights from the masters, or without optimizer state the weights alone, read as ranges;
    nothing is gathered. Formats 1-2 (every file holds its full weights): as they were saved."""
    rank = _rank()
    state = files.load_rank_state(root, iteration, rank, mmap=True)
    chunks, saved = stages.chunks, state[schema.MODEL]
    if len(saved) != len(chunks):
        path = schema.rank_file(schema.iteration_dir(root, iteration), rank)
        raise CheckpointError(f"{path} holds {len(saved)} model chunks, this run has {len(chunks)}")
    with_optim = load_optim and schema.OPTIMIZER in state
    if reader is None or reader.version < 3:
        with optimizer.gathered_params():
            for chunk, sd in zip(chunks, saved):
                chunk.load_state_dict(sd)
            optimizer.reload_model_params()
    elif with_optim:
        opt = dict(state[schema.OPTIMIZER])
        if optimizer.regions and (not opt[schema.SHARDS] or any(s is None for s in opt[schema.SHARDS])):
            opt[schema.SHARDS] = reader.replica_shards(rank)
        state = dict(state, **{schema.OPTIMIZER: opt})
    else:
        load_resharded(reader, chunks, optimizer, load_optim=False)  # same layout: its own ranges
    if with_optim:
        optimizer.load_state_dict(state[schema.OPTIMIZER])
    if reader is not None and reader.version >= 3:
        load_buffers(reader, chunks)
    return state


def load_run(root: str, *, topo, stages, optimizer, layout: dict, model_config=None, device=None,
             load_optim: bool = True, load_rng: bool = True, finetune: bool = False) -> Loaded | None:
    """Load the latest checkpoint under ``root`` into ``stages.chunks`` and ``optimizer``.

    Returns None (and says so) when ``root`` holds no checkpoint. ``model_config`` (with
    ``to_args()``; None skips the check) must agree with the saved model's shape; ``device``
    holds the one flag all ranks agree on. Collective."""
    iteration = files.latest_iteration(root)
    if iteration is None:
        _print0(f"no {schema.LATEST} in {root}: starting from scratch")
        return None
    meta = files.read_metadata(root, iteration)
    exact, reader = _choose_path(root, iteration, meta, topo=topo, stages=stages, optimizer=optimizer,
                                 layout=layout, model_config=model_config, device=device)
    t0 = time.time()
    if exact:
        state = _load_exact(root, iteration, stages, optimizer, load_optim, reader)
    else:
        load_resharded(reader, stages.chunks, optimizer, load_optim=load_optim)
        load_buffers(reader, stages.chunks)
        state = reader.rank_state(0)  # scheduler and counters: the same on every rank
        folder, saved = schema.iteration_dir(root, iteration), meta[schema.LAYOUT]
        how = (f"loaded {folder} in the layout it was saved in ({layout}), its ZeRO shards re-cut"
               if not schema.layout_diffs(saved, layout) else f"resharded {folder} (saved as {saved}) into {layout}")
        _print0(f"{how} in {time.time() - t0:.2f} s; note: RNG states are not restored when resharding, "
                "this run's --seed streams are used")
    path = "exact" if exact else "resharded"
    read = reader.bytes_read if reader is not None else 0
    if exact:  # the fp32 state restored as saved (the weights, if read, are counted by the reader)
        read += _nbytes(state.get(schema.OPTIMIZER, {}).get(schema.SHARDS)) if load_optim else 0
        if reader is None or reader.version < 3:
            read += _nbytes(state[schema.MODEL])
    if finetune:
        _print0(f"loaded weights from {root} iteration {iteration} (finetune: iteration 0)")
        return Loaded(path, 0, 0, None, None, read)
    if exact and load_rng and schema.RNG in state:
        restore_rng(state[schema.RNG], stages.rng_states)
    _print0(f"loaded checkpoint from {root} at iteration {iteration}")
    return Loaded(path, meta[schema.ITERATION], meta[schema.CONSUMED_SAMPLES], state.get(schema.SCHEDULER),
                  dict(state[schema.COUNTERS]), read)
