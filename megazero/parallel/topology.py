"""The rank grid and every process group of a 3D-parallel run.

Ranks are laid out in Megatron-LM's order tp-cp-ep-dp-pp: tensor-parallel fastest, then
context-parallel, then data-parallel, then pipeline-parallel::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

so ``grid = arange(world).view(PP, DP, CP, TP)`` and a rank's coordinates are its index in that
grid. MoE expert layers use a second factorization of the same ranks, Megatron's expert grid
(core_v0.20.0 ``parallel_state.initialize_model_parallel``, ``expert_decoder_rank_generator``,
order tp-ep-dp-pp with expert TP ``ETP``, default TP)::

    rank = etp_rank + ETP * (ep_rank + EP * (edp_rank + EDP * pp_rank)),   EDP = TP CP DP / (ETP EP)

so ``egrid = arange(world).view(PP, EDP, EP, ETP)``: experts are sharded over ``EP`` ranks
carved out of each stage's ``TP x CP x DP`` ranks, each expert's weights split over ``ETP``,
and expert gradients reduced over the expert-data-parallel ``EDP`` ranks. With ``ETP = TP`` a
rank's ``ep_rank`` is its ``DP x CP`` index modulo ``EP``. Groups are slices of the grids:

* ``tp``             -- ``grid[pp, dp, cp, :]``  (the TP peers: consecutive ranks, same node)
* ``cp``             -- ``grid[pp, dp, :, tp]``  (one sequence's chunks; only created when CP > 1)
* ``dp``             -- ``grid[pp, :, cp, tp]``  (replicas of the same model shard)
* ``pp``             -- ``grid[:, dp, cp, tp]``  (the stages of one pipeline)
* ``model_parallel`` -- ``grid[:, dp, cp, :]``   (everything holding one model replica)
* ``tp_cp``          -- ``grid[pp, dp, :, :]``  (the ranks sharing one sequence: MoE router statistics)
* ``dp_cp``          -- ``grid[pp, :, :, tp]``  (replicas of a shard with their CP peers: dense gradients
  are averaged and ZeRO partitions over these ``DP x CP`` ranks; only created when CP > 1, else DP)
* ``ep``             -- ``egrid[pp, edp, :, etp]`` (the ranks that exchange tokens)
* ``etp``            -- ``egrid[pp, edp, ep, :]`` (one expert's weight shards)
* ``edp``            -- ``egrid[pp, :, ep, etp]`` (replicas of the same expert shard)
* ``tp_ep``          -- ``egrid[pp, edp, :, :]`` (Megatron's expert-tensor-and-model-parallel group,
  the all-gather dispatcher's domain); the four expert kinds are created only when EP > 1, ETP
  differs from TP, or CP > 1 -- otherwise they are the TP/DP groups (:meth:`Topology.expert_group`)
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

import torch.distributed as dist

from .layout import EXPERT_KINDS, GROUP_KINDS, chunk_placement, expert_groups_needed, layout

@dataclass
class Topology:
    """This rank's place in a (TP, PP, DP) grid, with its process groups once created.

    ``vp`` is the number of virtual pipeline stages (model chunks) per pipeline rank, and
    ``pipeline_schedule`` the schedule (its chunk placement: :func:`.layout.stage_of_chunk`); they
    shape no group but belong to the layout, so they live here too.
    """

    world_size: int
    rank: int
    tp: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert TP size; None: TP
    pipeline_schedule: str | None = None  # megazero.pipeline.SCHEDULES name; None: 1f1b / interleaved-1f1b
    groups: dict = field(default_factory=dict, repr=False)  # kind -> ProcessGroup of this rank
    rank_lists: dict = field(default_factory=dict, repr=False)  # kind -> this rank's group ranks
    group_options: dict = field(default_factory=dict, repr=False)  # create_groups' backend/timeout, for later groups

    def __post_init__(self) -> None:
        if self.etp is None:
            self.etp = self.tp
        all_groups = layout(self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        self.dp = self.world_size // (self.tp * self.cp * self.pp)
        self.tp_rank = self.rank % self.tp
        self.cp_rank = (self.rank // self.tp) % self.cp
        self.dp_rank = (self.rank // (self.tp * self.cp)) % self.dp
        self.pp_rank = self.rank // (self.tp * self.cp * self.dp)
        self.dp_cp, self.dp_cp_rank = self.dp * self.cp, self.dp_rank * self.cp + self.cp_rank
        stage_rank = self.rank % (self.tp * self.cp * self.dp)
        self.edp = self.tp * self.cp * self.dp // (self.etp * self.ep)
        self.etp_rank = stage_rank % self.etp
        self.ep_rank = (stage_rank // self.etp) % self.ep
        self.edp_rank = stage_rank // (self.etp * self.ep)
        for kind, lists in all_groups.items():
            mine = [ranks for ranks in lists if self.rank in ranks]
            self.rank_lists[kind] = mine[0] if mine else []

    # ---- coordinates -------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last virtual stage (the loss): pipeline rank PP - 1, or
        rank 0 with the V placement of ``zbv``/``dualpipev`` (:func:`.layout.stage_of_chunk`)."""
        if chunk_placement(self.pipeline_schedule) == "v":
            return self.pp_rank == 0
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

    def expert_group(self, kind: str):
        """The expert grid's group of ``kind`` (``ep``, ``etp``, ``edp``, ``tp_ep``): the created
        one, or when the expert grid equals the dense one (EP 1, ETP = TP, CP 1) the dense group
        it coincides with (``etp``/``tp_ep``: TP; ``edp``: DP; ``ep``: None, one rank)."""
        if kind not in EXPERT_KINDS:
            raise KeyError(f"unknown expert group kind {kind!r}; expected one of {EXPERT_KINDS}")
        if expert_groups_needed(self.tp, self.cp, self.ep, self.etp):
            return self.group(kind)
        return {"ep": None, "etp": self.group("tp"), "edp": self.group("dp"), "tp_ep": self.group("tp")}[kind]

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def dp_cp_group(self):
        """The ``DP x CP`` ranks of this shard (the DP group when CP = 1): dense gradients and ZeRO."""
        return self.group("dp_cp") if self.cp > 1 else self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def model_parallel_group(self):
        return self.group("model_parallel")

    @property
    def embedding_group(self):
        """The ranks holding the first or the last stage of this pipeline (tied embeddings): the
        first and last pipeline rank; with the V placement both stages are on pipeline rank 0,
        so the group is that rank alone -- the ``position_embedding`` group's ranks (the
        ``embedding`` rank lists are the schedule-blind layout's; pipeline rank PP - 1 is then in
        no embedding group)."""
        if chunk_placement(self.pipeline_schedule) == "v":
            return self.group("position_embedding")
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
        self.group_options = {"backend": backend, "timeout": timeout}
        for kind, lists in layout(self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp).items():
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
        extra = "".join(f" {k} {r}/{n}" for k, r, n in (("cp", self.cp_rank, self.cp), ("ep", self.ep_rank, self.ep),
                                                         ("etp", self.etp_rank, self.etp if self.etp != self.tp else 1),
                                                         ("edp", self.edp_rank, self.edp if self.ep > 1 else 1))
                        if n > 1)
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp}{extra} dp {self.dp_rank}/{self.dp} "
                f"pp {self.pp_rank}/{self.pp} vp {self.vp}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.parallel.topology",
                                     description="Print the process groups of a layout as JSON.")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    cli = parser.parse_args(argv)
    try:
        groups = layout(cli.world_size, cli.tensor_model_parallel_size, cli.pipeline_model_parallel_size,
                        cli.context_parallel_size, cli.expert_model_parallel_size, cli.expert_tensor_parallel_size)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    json.dump(groups, sys.stdout, indent=None)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
