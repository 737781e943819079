"""Context parallelism's sequence layout: one sequence split over ``CP`` ranks.

**Load-balanced layout.** The ``s`` positions are cut into ``2 CP`` chunks of ``L = s / (2 CP)``;
CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r`` (:func:`chunk_ids`), concatenated. Under a
causal mask chunk ``c`` attends to ``c + 1`` chunks, so every rank does ``2 CP + 1`` chunk-pairs
of work (Megatron-core's layout, ``get_batch_on_this_cp_rank``). Tokens, labels, loss mask and
positions are sliced the same way (:func:`slice_for_rank`); RoPE and learned positions use each
token's true position.
"""

from __future__ import annotations

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 CP``) CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def slice_for_rank(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This CP rank's chunks of ``t`` along its sequence dimension ``dim``, concatenated."""
    if cp == 1:
        return t
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {t.shape[dim]} is not divisible by 2 x CP = {2 * cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp, rank)], dim=dim)


def positions_for_rank(s_local: int, cp: int, rank: int, device) -> torch.Tensor:
    """The true positions (``[s_local]``) of this rank's tokens."""
    L = s_local // 2
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in chunk_ids(cp, rank)])
