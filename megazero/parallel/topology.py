"""The rank grid and every process group of a 3D-parallel run.

Ranks are laid out in Megatron-LM's order tp-cp-ep-dp-pp: tensor-parallel fastest, then
context-parallel, then data-parallel, then pipeline-parallel::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

so ``grid = arange(world).view(PP, DP, CP, TP)`` and a rank's coordinates are its index in that
grid. Expert parallelism is carved out of the ``DP x CP`` ranks of a stage (as Megatron's expert
grid): ``EP`` divides ``DP x CP``, and a rank's ``ep_rank`` is its ``DP x CP`` index modulo ``EP``.
Groups are slices of the grid:

* ``tp``             -- ``grid[pp, dp, cp, :]``  (the TP peers: consecutive ranks, same node)
* ``cp``             -- ``grid[pp, dp, :, tp]``  (one sequence's chunks; only created when CP > 1)
* ``dp``             -- ``grid[pp, :, cp, tp]``  (replicas of the same model shard)
* ``pp``             -- ``grid[:, dp, cp, tp]``  (the stages of one pipeline)
* ``model_parallel`` -- ``grid[:, dp, cp, :]``   (everything holding one model replica)
* ``ep``             -- consecutive runs of ``EP`` in ``grid[pp, :, :, tp]`` (only created when EP > 1)
* ``embedding``      -- first and last stage of each pipeline (tied word embeddings)
* ``position_embedding`` -- the first stage of each pipeline

Nothing here is module-level state: a :class:`Topology` is an ordinary object, so two of them
can live side by side in one test.  Rank lists are computed without any process group
(:func:`layout`); :meth:`Topology.create_groups` then creates the real groups.  Every rank must
create every group, in the same order, which ``create_groups`` guarantees.

Run ``python -m megazero.parallel.topology --world-size 16 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 4`` to print the groups as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_KINDS = ("tp", "dp", "pp", "model_parallel", "embedding", "position_embedding", "cp", "ep")


def layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """Return every group kind's rank lists for ``world_size`` ranks (no process groups); the
    ``cp`` and ``ep`` kinds only when that size is above 1.

    Raises ``ValueError`` when ``world_size`` is not divisible by ``tp * cp * pp`` or ``ep`` does
    not divide ``dp * cp``.
    """
    if min(tp, pp, cp, ep, world_size) < 1:
        raise ValueError(f"sizes must be positive: world {world_size}, TP {tp}, CP {cp}, EP {ep}, PP {pp}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP {tp} x CP {cp} x PP {pp} = {tp * cp * pp}")
    dp = world_size // (tp * cp * pp)
    if (dp * cp) % ep:
        raise ValueError(f"EP {ep} does not divide DP {dp} x CP {cp} = {dp * cp}")
    grid = torch.arange(world_size).view(pp, dp, cp, tp)
    groups = {
        "tp": grid.reshape(-1, tp).tolist(),
        "dp": grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist(),
        "pp": grid.permute(1, 2, 3, 0).reshape(-1, pp).tolist(),
        "model_parallel": grid.permute(1, 2, 0, 3).reshape(dp * cp, -1).tolist(),
    }
    if cp > 1:
        groups["cp"] = grid.permute(0, 1, 3, 2).reshape(-1, cp).tolist()
    if ep > 1:
        groups["ep"] = grid.permute(0, 3, 1, 2).reshape(-1, ep).tolist()
    ends = sorted({0, pp - 1})
    groups["embedding"] = [[r[i] for i in ends] for r in groups["pp"]]
    groups["position_embedding"] = [[r[0]] for r in groups["pp"]]
    return groups


@dataclass
class Topology:
    """This rank's place in a (TP, PP, DP) grid, with its process groups once created.

    ``vp`` is the number of virtual pipeline stages (model chunks) per pipeline rank; it shapes
    no group but belongs to the layout, so it lives here too.
    """

    world_size: int
    rank: int
    tp: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    groups: dict = field(default_factory=dict, repr=False)  # kind -> ProcessGroup of this rank
    rank_lists: dict = field(default_factory=dict, repr=False)  # kind -> this rank's group ranks

    def __post_init__(self) -> None:
        all_groups = layout(self.world_size, self.tp, self.pp, self.cp, self.ep)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        self.dp = self.world_size // (self.tp * self.cp * self.pp)
        self.tp_rank = self.rank % self.tp
        self.cp_rank = (self.rank // self.tp) % self.cp
        self.dp_rank = (self.rank // (self.tp * self.cp)) % self.dp
        self.pp_rank = self.rank // (self.tp * self.cp * self.dp)
        self.ep_rank = (self.dp_rank * self.cp + self.cp_rank) % self.ep
        for kind, lists in all_groups.items():
            mine = [ranks for ranks in lists if self.rank in ranks]
            self.rank_lists[kind] = mine[0] if mine else []

    # ---- coordinates -------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping around, for virtual stages)."""
        return self.rank_lists["pp"][(self.pp_rank + 1) % self.pp]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping around)."""
        return self.rank_lists["pp"][(self.pp_rank - 1) % self.pp]

    def group(self, kind: str):
        """This rank's process group of ``kind`` (one of :data:`GROUP_KINDS`), or None."""
        if kind not in GROUP_KINDS:
            raise KeyError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        if not self.groups:
            raise RuntimeError("process groups not created; call Topology.create_groups() first")
        return self.groups.get(kind)

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def model_parallel_group(self):
        return self.group("model_parallel")

    @property
    def embedding_group(self):
        return self.group("embedding")

    # ---- process groups ----------------------------------------------------------------
    def create_groups(self, backend: str | None = None, timeout: timedelta | None = None) -> "Topology":
        """Create every group of every kind (collective: all ranks call it, same order).

        Requires ``torch.distributed`` initialized with this topology's world size. ``timeout``
        (``--distributed-timeout-minutes``) bounds every collective of every group: a peer that
        stops answering makes the call raise instead of blocking forever.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"topology world size {self.world_size} != process group world size {dist.get_world_size()}")
        for kind, lists in layout(self.world_size, self.tp, self.pp, self.cp, self.ep).items():
            seen = set()
            for ranks in lists:
                key = tuple(ranks)
                if key in seen:  # e.g. embedding == position_embedding lists when PP == 1
                    continue
                seen.add(key)
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if self.rank in ranks and kind not in self.groups:
                    self.groups[kind] = group
        return self

    def describe(self) -> str:
        extra = "".join(f" {k} {r}/{n}" for k, r, n in (("cp", self.cp_rank, self.cp), ("ep", self.ep_rank, self.ep))
                        if n > 1)
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp}{extra} dp {self.dp_rank}/{self.dp} "
                f"pp {self.pp_rank}/{self.pp} vp {self.vp}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.parallel.topology",
                                     description="Print the process groups of a layout as JSON.")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    cli = parser.parse_args(argv)
    try:
        groups = layout(cli.world_size, cli.tensor_model_parallel_size, cli.pipeline_model_parallel_size)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    json.dump(groups, sys.stdout, indent=None)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
