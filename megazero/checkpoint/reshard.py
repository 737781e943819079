"""Load a checkpoint saved in any (TP, PP, VP, DP, ZeRO stage, dtype) layout into this run's.

Saving: every rank describes its file with :func:`rank_index` (its chunks' parameters with name,
TP split rule and local shape; its ZeRO regions with their ordered ``(name, offset, numel)`` and
this rank's shard); rank 0 gathers these small descriptions into ``metadata.json["index"]``
(:mod:`megazero.checkpoint.schema`). Nothing else is gathered: each rank writes only what it owns.

Loading (:func:`load_resharded`), for every parameter this rank holds in the new layout, only
the elements ``[a, b)`` of its flat TP-local tensor that fall in this rank's new ZeRO shard
(:meth:`ZeroOptimizer.load_param_ranges`):

* optimizer (unless ``--no-load-optim``): fp32 master, ``exp_avg`` and ``exp_avg_sq`` ranges;
  the parameters are then written back from the masters, exactly as after an optimizer step
  (so fp32 -> bf16 rounds the master once);
* weights only: the weight's range into the master (rounded to the parameter dtype), then the
  same write-back; moments untouched;
* a range is ``to_local(module, name, full)`` of the full tensor when the TP split changed
  (padding rows of the new vocabulary split are zero);
* the optimizer step count and loss scaler come from rank 0's file (they are equal on all ranks).

Each rank asks only for the elements inside its new ZeRO shard: with the TP split unchanged
they are read as byte ranges of the old (memory-mapped) files, so a rank reads about its share;
when the TP size changes, one full parameter at a time is rebuilt and sliced.

MoE: a routed expert's weight (its module has ``expert_parallel``) is on the expert grid -- only
its EP rank holds it, split over expert TP (``etp_rank`` of ``etp``), kept whole by expert-DP
rank 0 and sharded over expert DP -- so it is indexed and read with those coordinates; found by
name, it loads into any EP size. Persistent buffers (the router's ``expert_bias``) are indexed as
``buffers`` and loaded whole (:func:`load_buffers`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.checkpoint import schema
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.schema import CheckpointError
from megazero.model.saved_args import model_arg_diffs
from megazero.tensor_parallel.spec import named_tp_params, to_local

OPT_KINDS = ("master", "exp_avg", "exp_avg_sq")


def named_parameters(chunks):
    """``(chunk index, name, owning module, local name, param, split)`` of every parameter, once."""
    seen = set()
    for c, chunk in enumerate(chunks):
        for name, module, p_name, p, split in named_tp_params(chunk):
            if id(p) not in seen:
                seen.add(id(p))
                yield c, name, module, p_name, p, split


def is_expert(module) -> bool:
    """Whether ``module``'s parameters are a routed expert's (on the expert grid)."""
    return bool(getattr(module, "expert_parallel", False))


def persistent_buffers(chunks):
    """``(chunk index, name, buffer)`` of every persistent buffer (saved state), once."""
    seen = set()
    for c, chunk in enumerate(chunks):
        for mod_name, module in chunk.named_modules():
            for b_name, buf in module.named_buffers(recurse=False):
                if buf is None or b_name in module._non_persistent_buffers_set or id(buf) in seen:
                    continue
                seen.add(id(buf))
                yield c, (f"{mod_name}.{b_name}" if mod_name else b_name), buf


def rank_index(topo, chunks, optimizer) -> dict:
    """This rank's entry of the index (:func:`schema.index_entry`), with where its file stores
    each weight: ``"shard"`` for a parameter of a partitioned (ZeRO-3) region, ``"model"`` on DP
    rank 0 of the parameter's grid (DP x CP; expert-DP rank 0 for a routed expert's) for the others,
    ``None`` (that rank's file has it) elsewhere; buffers ``"model"`` on DP rank 0."""
    name_of = {id(p): name for _, name, _, _, p, _ in named_parameters(chunks)}
    regions = optimizer.layout(name_of)
    sharded = {name for r in regions if r["partitioned"] for name, _, _ in r["params"]}
    params = []
    for c, name, module, _, p, split in named_parameters(chunks):
        expert = is_expert(module)
        first = (topo.edp_rank if expert else topo.dp_cp_rank) == 0
        stored = schema.STORED_SHARD if name in sharded else (schema.STORED_MODEL if first else None)
        params.append(schema.ParamEntry(c, name, tuple(p.shape), split, stored, expert))
    buffers = [schema.ParamEntry(c, name, tuple(b.shape), None, schema.STORED_MODEL if topo.dp_cp_rank == 0 else None)
               for c, name, b in persistent_buffers(chunks)]
    coords = (topo.ep_rank, topo.etp_rank, topo.edp_rank) if any(p.expert for p in params) else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    # the dense grid's replica index is over DP x CP (ZeRO's group; = DP rank without CP)
    return schema.index_entry(rank, topo.tp_rank, topo.pp_rank, topo.dp_cp_rank, params, regions, coords, buffers)


def same_layout(reader: CheckpointReader, layout: dict, index: dict) -> bool:
    """True when the fast path applies: same layout and this rank's file has the same contents
    (compared in the checkpoint's own index version)."""
    if schema.layout_diffs(reader.layout, layout):
        return False
    return reader.rank_index(index["rank"]) == schema.comparable_entry(index, reader.version)


def check_model_shape(reader: CheckpointReader, model_config) -> None:
    """Refuse a checkpoint of another model (the parallel layout may differ, the model may not):
    the saved arguments must agree with ``model_config.to_args()`` on every model-defining
    argument recorded in both (:data:`~megazero.model.saved_args.MODEL_KEYS`: shapes, activation,
    normalization, positions, biases, tying, GQA, router)."""
    diffs = model_arg_diffs(reader.args, model_config.to_args())
    if diffs:
        raise CheckpointError(model_mismatch_message(str(reader.directory), diffs))


def model_mismatch_message(where: str, diffs: list[str]) -> str:
    """The one line that refuses a load of another model, naming every difference."""
    return (f"{where} holds another model than the command line describes: " + "; ".join(diffs)
            + " (give the checkpoint's values, or --use-checkpoint-args to take them from it)")


@torch.no_grad()
def load_resharded(reader: CheckpointReader, chunks, optimizer, load_optim: bool = True) -> bool:
    """Load weights (and, if ``load_optim`` and saved, optimizer state) into this rank's layout.

    Every region asks only for the elements inside this rank's ZeRO shard
    (:meth:`ZeroOptimizer.load_param_ranges`); :meth:`CheckpointReader.local_range` reads just
    those from the memory-mapped files when the TP split is unchanged, else slices the full
    tensor. Without optimizer state the masters take the weights (moments untouched). Returns
    whether the optimizer state was loaded. Collective (the ZeRO write-back)."""
    topo = optimizer.topo
    info = {id(p): (name, module, p_name) for _, name, module, p_name, p, _ in named_parameters(chunks)}
    for name, _, _ in info.values():
        try:
            reader.resolve(name)
        except KeyError as e:
            raise CheckpointError(str(e.args[0])) from None

    def fetch(p, kind, a, b):
        name, module, p_name = info[id(p)]
        rank, size = (topo.etp_rank, topo.etp) if is_expert(module) else (topo.tp_rank, topo.tp)
        return reader.local_range(name, kind, rank, size, tuple(p.shape), a, b,
                                  to_local=lambda full: to_local(module, p_name, full, rank, size))

    with_optim = load_optim and reader.has_optimizer
    optimizer.load_param_ranges(fetch, OPT_KINDS if with_optim else ("weight",))
    if not with_optim:
        return False
    counters = reader.optimizer_counters()
    saved_scaler, scaler = counters["scaler"], optimizer.scaler.state_dict()
    if set(saved_scaler) != set(scaler):  # e.g. fp32 (constant 1.0) -> fp16 (dynamic): start afresh
        counters = dict(counters, scaler=scaler)
    optimizer.load_counters(counters)
    return True


@torch.no_grad()
def load_from_full(read, stages, optimizer, kinds) -> None:
    """Load ``kinds`` (``("weight",)`` or :data:`OPT_KINDS`) of every parameter this rank holds
    from ``read(name, kind)``, a source of *full* tensors under megazero's canonical names (a
    DCP folder, a Megatron-LM torch_dist folder): one parameter's full tensor at a time, cut to
    this rank's TP slice (a routed expert's: expert-TP) by its split rule, of which
    :meth:`ZeroOptimizer.load_param_ranges` takes the elements of this rank's ZeRO shard. A
    weight is cast to the parameter's dtype, a master or moment read as fp32. Collective."""
    topo = optimizer.topo
    info = {id(p): (name, module, p_name) for _, name, module, p_name, p, _ in named_parameters(stages.chunks)}
    cache = {}

    def fetch(p, kind, a, b):
        if (id(p), kind) not in cache:
            name, module, p_name = info[id(p)]
            cache.clear()  # one parameter's tensor at a time
            rank, size = (topo.etp_rank, topo.etp) if is_expert(module) else (topo.tp_rank, topo.tp)
            full = read(stages.aliases.get(name, name), kind)
            full = full.to(p.dtype if kind == "weight" else torch.float32)
            cache[(id(p), kind)] = to_local(module, p_name, full, rank, size).reshape(-1)
        return cache[(id(p), kind)][a:b]

    optimizer.load_param_ranges(fetch, kinds)


@torch.no_grad()
def load_buffers(reader: CheckpointReader, chunks) -> list[str]:
    """Copy every persistent buffer the checkpoint saved into ``chunks``' (whole, replicated);
    returns the names it holds none of (left as they are: e.g. a checkpoint saved before
    buffers were, or without ``--moe-router-enable-expert-bias``)."""
    missing = []
    for _, name, buf in persistent_buffers(chunks):
        if not reader.has_buffer(name):
            missing.append(name)
            continue
        saved = reader.full_param(name)
        if tuple(saved.shape) != tuple(buf.shape):
            raise CheckpointError(f"{reader.directory}: buffer {name!r} saved as {tuple(saved.shape)}, "
                                  f"this model's is {tuple(buf.shape)}")
        buf.copy_(saved)
    return missing
