"""Which torch.distributed primitive implements each logical collective, per backend.

The one place the choice is made, for tensor parallelism (``megazero.tensor_parallel.mappings``)
and ZeRO (``megazero.zero.collectives``) alike. Chosen by measurement (4 ranks, 4M fp32, one
thread each; see DESIGN.md and the two modules' docstrings):

=========  ==============================================  ==========================================
backend    reduce-scatter                                  all-gather
=========  ==============================================  ==========================================
nccl       ``reduce_scatter_tensor`` (a true ring op)      ``all_gather_into_tensor``
gloo       ``all_reduce`` + keep this rank's slice, 24-32  list ``all_gather``, 19-31 ms
           ms (list form 43-80 ms, tensor form 84-158 ms)  (``all_gather_into_tensor`` 57-59 ms)
=========  ==============================================  ==========================================

On gloo the reduce-scatter therefore moves an all-reduce's volume; whoever accounts for volume
reports both the logical operation and the primitive that ran.
"""

from __future__ import annotations

import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group``; ``None`` (no group: one process) counts as 1."""
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 without a group."""
    return dist.get_rank(group) if group is not None else 0


PRIMITIVES = {
    "nccl": {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
             "all_gather": "all_gather_into_tensor"},
    "gloo": {"all_reduce": "all_reduce", "reduce_scatter": "all_reduce+slice",
             "all_gather": "all_gather_list"},
}


def primitives_for(backend: str) -> dict:
    """A copy of the backend's table (backends other than gloo use NCCL's single-tensor ops)."""
    return dict(PRIMITIVES.get(str(backend), PRIMITIVES["nccl"]))
