"""Read a Megatron-LM ``--ckpt-format torch_dist`` checkpoint as full megazero tensors.

A torch_dist checkpoint is ``torch.distributed.checkpoint`` (DCP) underneath and is read with
it, in one process without process groups (``FileSystemReader``, ``dcp.load(no_dist=True)``).
What megatron-core 0.16.1 writes (observed: ``dist_checkpointing.save`` of ``GPTModel.
sharded_state_dict`` under Megatron-LM ``core_v0.16.1``'s ``save_checkpoint``, tests/peers/):

* ``DIR/latest_checkpointed_iteration.txt`` and ``DIR/iter_NNNNNNN/`` holding ``.metadata`` (DCP's:
  every key's global shape and chunks), ``__R_T.distcp`` (rank R's data), ``metadata.json``
  (``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (``torch.save`` of what is not a
  sharded tensor: ``args`` (a Namespace), ``checkpoint_version``, ``iteration``,
  ``content_metadata``; read with :func:`load_megatron_file`'s ``weights_only`` allow-list).
* Keys are the model's global names, independent of TP / PP / VP: ``embedding.word_embeddings.
  weight`` ``[padded V, h]``, ``output_layer.weight``, ``decoder.final_layernorm.*``, and the
  layers **stacked** on a leading axis of ``num_layers`` (``singleton_local_shards`` False,
  homogeneous layers): ``decoder.layers.self_attention.linear_qkv.weight`` ``[L, rows, h]``,
  the norms under TE's fused names (``linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) even for the local spec; non-homogeneous blocks write
  ``decoder.layers.N.*`` (accepted too). ``*._extra_state/shard_*`` (bytes), ``rng_state``,
  ``optimizer.*`` and ``rerun_state_machine`` entries are not read.
* Full tensors: QKV is every TP rank's ``[ng, (np/ng + 2) hn]`` grouped rows concatenated (regrouped
  to megazero's ``[Q; K; V]`` as the legacy reader does); SwiGLU's fc1 is already ``[gate; up]``
  (``apply_swiglu_sharded_factory`` stores the two halves at offsets ``t`` and ``TP + t``); the
  vocabulary rows are padded (cut to the real ones).

* MoE (observed at TP 1/2 x EP 2, ``SequentialMLP``): ``decoder.layers.mlp.router.weight``
  ``[L, E, h]`` (``router.expert_bias`` ``[L, E]``), the routed experts stacked on the layer and
  the *global* expert axis, ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2f, h]``
  (``[gate; up]``) and ``linear_fc2.weight`` ``[L, E, h, f]``, whatever the EP / expert-TP;
  ``mlp.shared_experts.linear_fc1/linear_fc2.weight`` and ``gate_weight``. A ``moe_layer_freq``
  list (or > 1) makes the block non-homogeneous: ``decoder.layers.N.*`` without the layer axis.
  megazero: ``layers.N.mlp.router.*``, ``layers.N.mlp.experts.e.fc1/fc2.weight``,
  ``layers.N.mlp.shared_expert.fc1/fc2.weight``, ``layers.N.mlp.shared_expert_gate.weight``.

Memory: one parameter. Each is read as its slice of the stored tensor (one layer, one expert:
:class:`SlicePlanner`, DCP's own read-item planning for a rectangular piece), so only the saved
chunks overlapping it are read (megatron-core stores each layer's pieces as their own chunks).
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megazero.checkpoint.convert.megatron import (TRACKER, config_from_megatron_args, load_megatron_file,
                                                  megazero_name)
from megazero.checkpoint.schema import CheckpointError, iteration_dir

__all__ = ["MegatronDistCheckpoint", "is_torch_dist", "torch_dist_directory"]

LAYER_KEY = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
EXPERTS = re.compile(r"^mlp\.experts\.experts\.linear_(fc[12])\.weight$")
MOE_PARTS = {"mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.expert_bias",
             "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.fc1.weight",
             "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.fc2.weight",
             "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
SKIPPED = re.compile(r"(_extra_state(/.*)?$|^optimizer\.|^rng_state|^rerun_state_machine)")


def torch_dist_directory(root: str, iteration: int | None = None) -> tuple[str, int] | None:
    """(iteration folder, iteration) when ``root`` (a tracker's folder) or its ``iteration``
    holds a torch_dist checkpoint (a DCP ``.metadata`` file), else None."""
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.isfile(tracker):
            return None
        text = open(tracker).read().strip()
        if not text.isdigit():
            return None
        iteration = int(text)
    directory = iteration_dir(root, iteration)
    return (directory, iteration) if os.path.isfile(os.path.join(directory, ".metadata")) else None


def is_torch_dist(root: str, iteration: int | None = None) -> bool:
    return torch_dist_directory(root, iteration) is not None


def _common_args(directory: str) -> dict:
    meta = os.path.join(directory, "metadata.json")
    try:
        with open(meta) as fh:
            backend = json.load(fh).get("sharded_backend")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta}: cannot be read ({e})") from e
    if backend != "torch_dist":
        raise CheckpointError(f"{meta}: sharded_backend {backend!r}, only 'torch_dist' is read")
    common = os.path.join(directory, "common.pt")
    if not os.path.isfile(common):
        raise CheckpointError(f"{common} is missing (the run's args are there)")
    args = load_megatron_file(common).get("args")
    if args is None:
        raise CheckpointError(f"{common}: no 'args' (the model cannot be known)")
    return dict(vars(args))


class SlicePlanner(DefaultLoadPlanner):
    """DCP's default load planner for one rectangular piece of each requested tensor: the state
    dict holds a buffer of the piece's shape per key, ``offsets[key]`` its place in the saved
    tensor; read items come from DCP's ``create_read_items_for_chunk_list`` for that piece."""

    def __init__(self, offsets: dict):
        super().__init__()
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, buf in self.state_dict.items():
            piece = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]), sizes=buf.size())
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [piece])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # a plain buffer: the item's offsets are relative to the piece


class MegatronDistCheckpoint:
    """Full megazero tensors of a torch_dist checkpoint (see the module doc); the same interface
    as :class:`megazero.checkpoint.convert.megatron.MegatronCheckpoint`: ``config``,
    ``iteration``, ``directory``, ``args``, ``tokenizer_flags``, ``full_tensor(name)``."""

    def __init__(self, root: str, iteration: int | None = None, vocab_size: int | None = None):
        from megazero.data.tokenizers import TOKENIZER_FLAGS, TOKENIZER_TYPES
        found = torch_dist_directory(root, iteration)
        if found is None:
            raise CheckpointError(f"{root}: no torch_dist checkpoint (no iter_*/.metadata)")
        self.directory, self.iteration = found
        self.args = _common_args(self.directory)
        try:
            self.config = config_from_megatron_args(self.args, vocab_size, "mcore")
        except CheckpointError as e:  # name the file whose args say it
            raise CheckpointError(f"{os.path.join(self.directory, 'common.pt')}: {e}") from None
        self.reader = dcp.FileSystemReader(self.directory)
        try:
            self.meta = self.reader.read_metadata().state_dict_metadata
        except Exception as e:  # a truncated .metadata: any unpickling error
            raise CheckpointError(f"{self.directory}/.metadata: cannot be read ({type(e).__name__}: {e})") from e
        try:
            self.sources = self._map()
        except CheckpointError as e:
            text = str(e)
            raise CheckpointError(text if text.startswith(self.directory) else f"{self.directory}: {text}") from None
        kind = self.args.get("tokenizer_type")
        self.tokenizer_flags = ({k: self.args[k] for k in TOKENIZER_FLAGS if self.args.get(k) is not None}
                                if kind in TOKENIZER_TYPES else {})

    def _map(self) -> dict:
        """{megazero name: (DCP key, index into the saved tensor: (layer,), (layer, expert), (expert,) or ())}."""
        out = {}
        for key, item in self.meta.items():
            if SKIPPED.search(key):
                continue
            m = LAYER_KEY.match(key)
            if m is None:
                hit = megazero_name(key)
                if hit is not None:
                    out[hit[0]] = (key, ())
                continue
            if m.group(1) is None and item.size[0] != self.config.num_layers:
                raise CheckpointError(f"{self.directory}: {key} stacks {item.size[0]} layers, args say "
                                      f"{self.config.num_layers}")
            layers = [(int(m.group(1)), ())] if m.group(1) else [(i, (i,)) for i in range(self.config.num_layers)]
            for layer, index in layers:
                out.update(self._layer_names(key, m.group(2), layer, index, item))
        if self.config.tied_embeddings:
            out.pop("output_layer.weight", None)
        return out

    def _layer_names(self, key: str, rest: str, layer: int, index: tuple, item) -> dict:
        """The megazero names of one layer's part of ``key`` (``rest`` after ``decoder.layers.[N.]``):
        routed experts carry an expert axis after the layer's (``[L, E, ...]`` or ``[E, ...]``)."""
        moe_part = EXPERTS.match(rest) or rest in MOE_PARTS
        if moe_part and self.config.moe is None:
            raise CheckpointError(f"{self.directory}: {key}: an MoE weight in a checkpoint whose args have no "
                                  "num_experts")
        m = EXPERTS.match(rest)
        if m:
            experts = item.size[len(index)]
            return {f"layers.{layer}.mlp.experts.{e}.{m.group(1)}.weight": (key, (*index, e)) for e in range(experts)}
        if rest in MOE_PARTS:
            return {f"layers.{layer}.{MOE_PARTS[rest]}": (key, index)}
        hit = megazero_name(f"decoder.layers.{layer}.{rest}")
        return {} if hit is None else {hit[0]: (key, index)}

    def _load(self, key: str, index: tuple) -> torch.Tensor:
        """The saved tensor ``key`` at leading ``index`` (a layer, a layer and an expert, or ())."""
        item = self.meta[key]
        covered = sum(torch.Size(c.sizes).numel() for c in item.chunks)
        if covered != item.size.numel():
            raise CheckpointError(f"{self.directory}: {key}: the saved pieces cover {covered} of "
                                  f"{item.size.numel()} elements")
        self._check_files(key)
        shape = (1,) * len(index) + tuple(item.size[len(index):])
        target = {key: torch.empty(shape, dtype=item.properties.dtype)}
        offsets = {key: (*index, *(0,) * (len(shape) - len(index)))}
        try:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": meant so
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(target, storage_reader=self.reader, planner=SlicePlanner(offsets), no_dist=True)
        except (Exception, CheckpointException) as e:  # a short .distcp file: DCP's wrapped errors
            inner = next(iter(e.failures.values()), e) if isinstance(e, CheckpointException) else e
            cause = f"{type(inner).__name__}: {str(inner).strip().splitlines()[-1] if str(inner).strip() else ''}"
            raise CheckpointError(f"{self.directory}: cannot read {key} ({cause})") from e
        return target[key].reshape(item.size[len(index):])

    def _check_files(self, key: str) -> None:
        """Every ``.distcp`` file holding a piece of ``key`` is there (DCP's ``storage_data``)."""
        storage = self.reader.read_metadata().storage_data or {}
        for index, info in storage.items():
            path = os.path.join(self.directory, getattr(info, "relative_path", ""))
            if index.fqn == key and not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing (it holds part of {key}): an incomplete torch_dist checkpoint")

    def full_tensor(self, name: str) -> torch.Tensor:
        if name not in self.sources:
            raise CheckpointError(f"{self.directory}: no {name} in the checkpoint")
        key, index = self.sources[name]
        full = self._load(key, index)
        c = self.config
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if suffix.startswith("attention.qkv."):
            per_group = c.num_attention_heads // c.num_query_groups * c.kv_channels
            grouped = full.reshape(c.num_query_groups, per_group + 2 * c.kv_channels, *full.shape[1:])
            q, k, v = grouped.split([per_group, c.kv_channels, c.kv_channels], 1)
            return torch.cat([x.reshape(-1, *full.shape[1:]) for x in (q, k, v)], 0)
        if suffix in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return full[:c.vocab_size]
        return full

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
