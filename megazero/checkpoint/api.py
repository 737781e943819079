"""Save and load a training run: what ``Trainer.save`` / ``Trainer.load`` call.

:func:`save_run` (collective): every rank writes its own file (:func:`schema.rank_state`: model
chunks gathered under ZeRO-3, optimizer shard, LR scheduler, counters, RNG); rank 0 gathers every
rank's index entry (:func:`reshard.rank_index`) and writes ``metadata.json`` with the layout, the
saved arguments and the model's aliases, so that any layout can load it.

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
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.reshard import check_model_shape, load_resharded, rank_index, same_layout
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _print0(text: str) -> None:
    if _rank() == 0:
        print(text, flush=True)


def save_run(root: str, *, topo, stages, optimizer, scheduler_state: dict | None, counters: dict, iteration: int,
             consumed_samples: int, layout: dict, saved_args: dict, save_optim: bool = True,
             save_rng: bool = True) -> str:
    """Save checkpoint ``iteration`` under ``root``; returns its folder. Collective.

    ``stages``: a :class:`~megazero.model.stages.ModelStages` (``chunks``, ``rng_states``,
    ``aliases``); ``counters``: ``{"skipped", "nans"}``; ``layout``: :func:`schema.layout`;
    ``saved_args``: JSON values recorded as the run's arguments (with the model's keys)."""
    with optimizer.gathered_params():  # ZeRO-3: materialize the partitioned parameters
        model = [{k: v.detach().clone() for k, v in c.state_dict().items()} for c in stages.chunks]
    state = schema.rank_state(model, scheduler_state, counters,
                              rng=rng_state(stages.rng_states) if save_rng else None,
                              optimizer=optimizer.state_dict() if save_optim else None)
    index = rank_index(topo, stages.chunks, optimizer)
    rank = _rank()
    if dist.is_initialized():
        indices = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(index, indices, dst=0)
    else:
        indices = [index]
    meta = schema.metadata(iteration, consumed_samples, layout, saved_args,
                           schema.make_index(indices or [], stages.aliases)) if rank == 0 else {}
    return files.save_checkpoint(root, iteration, rank, state, meta)


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


def _load_exact(root: str, iteration: int, stages, optimizer, load_optim: bool) -> dict:
    """This rank's file as saved into the chunks (and optimizer); returns the file's contents."""
    rank = _rank()
    state = files.load_rank_state(root, iteration, rank)
    chunks, saved = stages.chunks, state[schema.MODEL]
    if len(saved) != len(chunks):
        path = schema.rank_file(schema.iteration_dir(root, iteration), rank)
        raise CheckpointError(f"{path} holds {len(saved)} model chunks, this run has {len(chunks)}")
    with optimizer.gathered_params():
        for chunk, sd in zip(chunks, saved):
            chunk.load_state_dict(sd)
        optimizer.reload_model_params()
    if load_optim and schema.OPTIMIZER in state:
        optimizer.load_state_dict(state[schema.OPTIMIZER])
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
        state = _load_exact(root, iteration, stages, optimizer, load_optim)
    else:
        load_resharded(reader, stages.chunks, optimizer, load_optim=load_optim)
        state = reader.rank_state(0)  # scheduler and counters: the same on every rank
        _print0(f"resharded {schema.iteration_dir(root, iteration)} (saved as {meta[schema.LAYOUT]}) into "
                f"{layout} in {time.time() - t0:.2f} s; note: RNG states are not restored across layouts, "
                "this run's --seed streams are used")
    path = "exact" if exact else "resharded"
    if finetune:
        _print0(f"loaded weights from {root} iteration {iteration} (finetune: iteration 0)")
        return Loaded(path, 0, 0, None, None)
    if exact and load_rng and schema.RNG in state:
        restore_rng(state[schema.RNG], stages.rng_states)
    _print0(f"loaded checkpoint from {root} at iteration {iteration}")
    return Loaded(path, meta[schema.ITERATION], meta[schema.CONSUMED_SAMPLES], state.get(schema.SCHEDULER),
                  dict(state[schema.COUNTERS]))
