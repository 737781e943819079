"""A model as the generic packages see it: this rank's pipeline chunks and the plain objects
that pipeline/, zero/, checkpoint/ and training/ need, so none of them knows which model it is.

:class:`ModelStages` is what a ``model_provider(model_config, topo)`` returns; :func:`gpt_stages`
builds it for the GPT (Megatron's interleaved layer assignment, tied word embeddings synced over
the embedding group). A model that is not a GPT builds its own (tests/test_non_gpt_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelStages:
    """This rank's share of a model split over pipeline stages.

    * ``chunks``: the VP model chunks of this pipeline rank, in virtual-stage order; chunk ``c``
      of pipeline rank ``r`` is virtual stage ``c * PP + r``.
    * ``activation_shape`` / ``activation_dtype``: the tensor one stage sends the next (and the
      gradient sent back), the same for every micro-batch, e.g. ``(s, b, h)`` (``s / TP`` with
      sequence parallelism).
    * ``shared_params``: ``[(param, process_group)]``, copies of one weight held on several stages
      (tied embeddings): their gradients are summed over the group before the DP reduction, so
      the copies take the same step; ``[]`` when nothing is shared.
    * ``tp_duplicated_params``: parameters replicated over TP, counted once in the gradient norm.
    * ``rng_states``: objects with ``state_dict()``/``load_state_dict()`` (one per chunk, e.g. the
      dropout RNG trackers) that a checkpoint saves and an exact resume restores.
    * ``aliases``: ``{copy name: canonical name}`` of the shared parameters, so a checkpoint reader
      can read a copy from its canonical parameter (and writers may skip it).
    """

    chunks: list[nn.Module]
    activation_shape: tuple[int, ...]
    activation_dtype: torch.dtype
    shared_params: list[tuple[nn.Parameter, Any]] = field(default_factory=list)
    tp_duplicated_params: list[nn.Parameter] = field(default_factory=list)
    rng_states: list = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


ForwardStep = Callable[[nn.Module, dict, "torch.Tensor | None"], torch.Tensor]
