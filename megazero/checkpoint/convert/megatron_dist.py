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

Memory: each stacked tensor read is kept until the conversion ends (about one copy of the
weights, as the legacy reader). MoE (``mlp.experts.*``, ``mlp.router.*``) is refused by name.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megazero.checkpoint.convert.megatron import (TRACKER, config_from_megatron_args, load_megatron_file,
                                                  megazero_name)
from megazero.checkpoint.schema import CheckpointError, iteration_dir

__all__ = ["MegatronDistCheckpoint", "is_torch_dist", "torch_dist_directory"]

STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
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
        if self.args.get("num_experts"):
            raise CheckpointError(f"{self.directory}: an MoE torch_dist checkpoint (num_experts "
                                  f"{self.args['num_experts']}): not read yet; convert it to --ckpt-format torch "
                                  "with Megatron-LM and use from-megatron on that")
        self.config = config_from_megatron_args(self.args, vocab_size, "mcore")
        self.reader = dcp.FileSystemReader(self.directory)
        try:
            self.meta = self.reader.read_metadata().state_dict_metadata
        except Exception as e:  # a truncated .metadata: any unpickling error
            raise CheckpointError(f"{self.directory}/.metadata: cannot be read ({type(e).__name__}: {e})") from e
        self.sources = self._map()
        self.loaded: dict[str, torch.Tensor] = {}
        kind = self.args.get("tokenizer_type")
        self.tokenizer_flags = ({k: self.args[k] for k in TOKENIZER_FLAGS if self.args.get(k) is not None}
                                if kind in TOKENIZER_TYPES else {})

    def _map(self) -> dict:
        """{megazero name: (DCP key, layer index into the stacked axis or None)}."""
        out = {}
        layers = self.config.num_layers
        for key, item in self.meta.items():
            if SKIPPED.search(key):
                continue
            if ".mlp.experts." in key or ".mlp.router." in key or ".mlp.shared_experts." in key:
                raise CheckpointError(f"{self.directory}: {key}: MoE weights in a checkpoint whose args have no "
                                      "num_experts")
            stacked = STACKED.match(key)
            if stacked:
                if item.size[0] != layers:
                    raise CheckpointError(f"{self.directory}: {key} stacks {item.size[0]} layers, args say {layers}")
                for i in range(layers):
                    name, _ = megazero_name(f"decoder.layers.{i}.{stacked.group(1)}")
                    out[name] = (key, i)
                continue
            hit = megazero_name(key)
            if hit is not None:
                out[hit[0]] = (key, None)
        if self.config.tied_embeddings:
            out.pop("output_layer.weight", None)
        return out

    def _load(self, key: str) -> torch.Tensor:
        if key not in self.loaded:
            item = self.meta[key]
            covered = sum(torch.Size(c.sizes).numel() for c in item.chunks)
            if covered != item.size.numel():
                raise CheckpointError(f"{self.directory}: {key}: the saved pieces cover {covered} of "
                                      f"{item.size.numel()} elements")
            self._check_files(key)
            target = {key: torch.empty(item.size, dtype=item.properties.dtype)}
            try:
                with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": meant so
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load(target, storage_reader=self.reader, no_dist=True)
            except (Exception, CheckpointException) as e:  # a short .distcp file: DCP's wrapped errors
                inner = next(iter(e.failures.values()), e) if isinstance(e, CheckpointException) else e
                cause = f"{type(inner).__name__}: {str(inner).strip().splitlines()[-1] if str(inner).strip() else ''}"
                raise CheckpointError(f"{self.directory}: cannot read {key} ({cause})") from e
            self.loaded[key] = target[key]
        return self.loaded[key]

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
        key, layer = self.sources[name]
        full = self._load(key) if layer is None else self._load(key)[layer]
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
        self.loaded = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
