"""``megazero.load_model(path)``: a checkpoint as one ``nn.Module`` in one process.

The checkpoint may have been saved at any TP x PP x DP layout and ZeRO stage: its index lets
:class:`~megazero.checkpoint.reader.CheckpointReader` assemble each parameter's full, unpadded
tensor (one at a time), which is copied into a single-stage, TP-1 :class:`GPTModel` built from
the saved arguments (:meth:`GPTConfig.from_saved_args`; no dropout, no recompute). Its forward
returns logits over the real vocabulary: the padded rows (zero weights, ``V' - V`` of them, see
:func:`~megazero.model.config.pad_vocab_size`) are sliced off, so ``logits.shape[-1]`` is the
tokenizer's ``vocab_size``. Persistent buffers (an MoE router's expert bias) are loaded too.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.reshard import load_buffers
from megazero.checkpoint.schema import CheckpointError
from megazero.model.config import GPTConfig
from megazero.model.gpt import GPTModel


class LoadedGPT(nn.Module):
    """A loaded GPT: ``forward(tokens [b, s] int64[, position_ids])`` -> logits ``[b, s, V]``
    (``V`` the real vocabulary). ``config``: the model's :class:`GPTConfig`; ``args``: the
    saving run's arguments (Megatron's names); ``iteration``: the checkpoint's."""

    def __init__(self, gpt: GPTModel, args: dict, iteration: int):
        super().__init__()
        self.gpt, self.config, self.args, self.iteration = gpt, gpt.config, args, iteration

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.gpt(tokens, position_ids)[..., :self.config.vocab_size]


def load_model(path: str, device="cpu", dtype: torch.dtype | None = None, iteration: int | None = None) -> LoadedGPT:
    """The checkpoint under ``path`` (its latest iteration, or ``iteration``) as a
    :class:`LoadedGPT` in eval mode on ``device``, in ``dtype`` (default: the saved
    ``params_dtype``). Needs no process group. Raises :class:`CheckpointError` naming the
    folder when a weight is missing."""
    reader = CheckpointReader(path, iteration)
    try:
        overrides = dict(sequence_parallel=False, recompute_granularity=None, attention_dropout=0.0,
                         hidden_dropout=0.0)
        if dtype is not None:
            overrides["params_dtype"] = dtype
        config = GPTConfig.from_saved_args(reader.args, **overrides)
        gpt = GPTModel(config, None, device=torch.device(device)).eval()
        wanted, loaded = {name for name, _ in gpt.named_parameters()}, set()
        for name, full in reader.iter_full_params(dtype=config.params_dtype):
            loaded |= wanted - set(gpt.load_full_state_dict({name: full}, strict=False))
        load_buffers(reader, [gpt])
        if wanted - loaded:
            raise CheckpointError(f"{reader.directory}: the checkpoint lacks {sorted(wanted - loaded)}")
        return LoadedGPT(gpt, dict(reader.args), reader.iteration).eval()
    finally:
        reader.close()
