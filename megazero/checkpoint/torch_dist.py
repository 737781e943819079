"""``--load DIR`` of a Megatron-LM ``--ckpt-format torch_dist`` checkpoint, straight into this
run's layout (any TP, PP, VP, DP, ZeRO stage, EP), as :func:`megazero.checkpoint.dcp.load_dcp`
loads a DCP folder: no converted copy is written anywhere.

* Told apart from megazero's own DCP folders (both hold DCP's ``.metadata``) by Megatron's
  ``metadata.json`` record ``{"sharded_backend": ...}`` (:func:`is_megatron_dist`).
* Weights: for each parameter this rank holds, its full tensor from
  :meth:`MegatronDistCheckpoint.full_tensor` (one parameter read at a time through DCP, QKV
  regrouped, vocabulary rows cut) sliced for this rank (:func:`~.reshard.load_from_full`); the
  persistent buffers the checkpoint has (an MoE router's ``expert_bias``) copied whole.
* Counters: the iteration is Megatron's saved one, the consumed samples its
  ``args.consumed_train_samples`` (0 when absent); the LR scheduler is not restored (megazero's
  starts afresh, as after ``tools/convert_checkpoint.py from-megatron``; the log line says so).
* Optimizer state: not read. Megatron-LM's default with ``--use-distributed-optimizer`` saves it
  in its distributed optimizer's bucket layout (``distrib_optim_sharding_type`` ``dp_reshardable``,
  megatron/core/optimizer/distrib_optimizer.py 0.16.1, ``sharded_param_state_dp_reshardable``:
  per-bucket flat tensors with Megatron's own padding and parameter order), which has no exact
  mapping without Megatron's bucketing; the other layouts are not yet checked against
  megatron-core. The weights load as ``--no-load-optim`` would, and the log line says so.
* The model flags: the checkpoint's model (:func:`config_from_megatron_args` of ``common.pt``'s
  ``args``) must agree with the command line's (:func:`model_arg_diffs`, each differing flag
  named); ``--use-checkpoint-args`` takes them from there (:func:`saved_args`).

Bad input (a missing or short ``.distcp`` file, a model megazero cannot build, a vocabulary larger
than the saved rows) is one :class:`CheckpointError` line naming the file, raised on every rank
before any tensor is read; the source folder is only read.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megazero.checkpoint import files, schema
from megazero.checkpoint.api import Loaded
from megazero.checkpoint.convert.megatron_dist import MegatronDistCheckpoint
from megazero.checkpoint.dcp import check_dcp_files
from megazero.checkpoint.reshard import load_from_full, model_mismatch_message, named_parameters, persistent_buffers
from megazero.checkpoint.schema import CheckpointError
from megazero.model.saved_args import model_arg_diffs

FORMAT = "torch_dist"


def is_megatron_dist(root: str, iteration: int) -> bool:
    """Whether ``iter_<iteration>`` under ``root`` is Megatron-LM's dist-checkpointing folder
    (its ``metadata.json`` names a ``sharded_backend``)."""
    path = schema.metadata_file(schema.iteration_dir(root, iteration))
    try:
        with open(path) as f:
            return "sharded_backend" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def _model_args(ck: MegatronDistCheckpoint) -> dict:
    """The saved arguments of a Megatron checkpoint as megazero records its own: the model's
    (``config.to_args``; the vocabulary only where Megatron's args know it, NullTokenizer's
    ``N + 1``: a real tokenizer's size is not recorded, only the padded rows) and its tokenizer."""
    out = {**ck.config.to_args(1), "attention_dropout": ck.config.attention_dropout,
           "hidden_dropout": ck.config.hidden_dropout, **ck.tokenizer_flags}
    if ck.args.get("tokenizer_type") != "NullTokenizer":
        out.pop("vocab_size")
    out.pop("padded_vocab_size")
    return out


def saved_args(root: str) -> dict | None:
    """The model (and tokenizer) arguments the latest checkpoint under ``root`` recorded, under
    Megatron's names, whether megazero's or Megatron-LM's torch_dist; None without a checkpoint."""
    iteration = files.latest_iteration(root)
    if iteration is None:
        return None
    if not is_megatron_dist(root, iteration):
        return files.read_metadata(root, iteration).get(schema.ARGS, {})
    return _model_args(MegatronDistCheckpoint(root, iteration))


def _open(root: str, iteration: int, model_config) -> MegatronDistCheckpoint:
    """The checkpoint, its files checked and its model compared with this run's."""
    ck = MegatronDistCheckpoint(root, iteration, vocab_size=model_config.vocab_size)
    check_dcp_files(ck.directory)
    padded = ck.args.get("padded_vocab_size")
    if padded is not None and model_config.vocab_size > padded:
        raise CheckpointError(f"{os.path.join(ck.directory, 'common.pt')}: the checkpoint has {padded} vocabulary "
                              f"rows, this run's vocabulary is {model_config.vocab_size} (another tokenizer?)")
    diffs = model_arg_diffs(ck.config.to_args(), model_config.to_args())
    if diffs:
        raise CheckpointError(model_mismatch_message(ck.directory, diffs))
    return ck


@torch.no_grad()
def _load_buffers(ck: MegatronDistCheckpoint, stages) -> list[str]:
    """Copy the persistent buffers the checkpoint has; returns the names it lacks (kept as built)."""
    missing = []
    for _, name, buf in persistent_buffers(stages.chunks):
        if name not in ck.sources:
            missing.append(name)
            continue
        saved = ck.full_tensor(name)
        if saved.numel() != buf.numel():
            raise CheckpointError(f"{ck.directory}: {ck.sources[name][0]} gives {tuple(saved.shape)} for {name}, "
                                  f"this model's is {tuple(buf.shape)}")
        buf.copy_(saved.reshape(buf.shape))
    return missing


def load_torch_dist(root: str, iteration: int, *, topo, stages, optimizer, model_config, load_optim: bool = True,
                    finetune: bool = False) -> Loaded:
    """Load Megatron-LM's torch_dist checkpoint ``iteration`` under ``root`` into this run's
    layout (module doc): weights and persistent buffers; no optimizer state, no LR scheduler,
    no RNG. Collective (the ZeRO write-back)."""
    ck = _open(root, iteration, model_config)
    for _, name, _, _, _, _ in named_parameters(stages.chunks):
        if stages.aliases.get(name, name) not in ck.sources:
            raise CheckpointError(f"{ck.directory}: no tensor for {stages.aliases.get(name, name)} (.metadata has "
                                  "none that maps to it): not this model's checkpoint")
    load_from_full(lambda name, kind: ck.full_tensor(name), stages, optimizer, ("weight",))
    missing = _load_buffers(ck, stages)
    consumed = int(ck.args.get("consumed_train_samples") or 0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        optim = [k for k in ck.meta if k.startswith("optimizer.")]
        print(f"loaded Megatron-LM torch_dist checkpoint {ck.directory} (iteration {ck.iteration}, consumed "
              f"samples {consumed}) into {topo.tp=}, {topo.pp=}, {topo.dp=}; note: "
              + (f"its optimizer state ({len(optim)} optimizer.* entries) was not read, --no-load-optim implied"
                 if optim else "it holds no optimizer state")
              + "; the LR scheduler starts afresh; RNG states are not restored"
              + (f"; no saved {', '.join(missing)}: kept as built" if missing else ""), flush=True)
    if finetune:
        return Loaded(FORMAT, 0, 0, None, None)
    return Loaded(FORMAT, ck.iteration, consumed, None, None)
