"""Tensor parallelism: autograd collectives, parallel layers, vocab-parallel loss, dropout RNG.

See docs/tensor_parallel.md for the math of every piece.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, default_device,
                     gather_tensor, init_seed, seeded_normal)
from .mappings import (all_gather_dim0, copy_to_tp_region, gather_from_sequence_parallel_region,
                       gather_from_tp_region, reduce_from_tp_region, reduce_scatter_dim0,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tp_region)
from .random import RNGTracker, checkpoint, dropout
from .spec import TPSplit, named_tp_params, shard, to_full, to_local, tp_duplicated_params, tp_split, unshard

__all__ = [
    "vocab_parallel_cross_entropy", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "default_device", "gather_tensor", "init_seed", "seeded_normal", "shard", "unshard",
    "all_gather_dim0", "copy_to_tp_region", "gather_from_sequence_parallel_region", "gather_from_tp_region",
    "reduce_from_tp_region", "reduce_scatter_dim0", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tp_region", "RNGTracker", "checkpoint", "dropout",
    "TPSplit", "named_tp_params", "to_full", "to_local", "tp_duplicated_params", "tp_split",
]
