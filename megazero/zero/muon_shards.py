"""Muon over ZeRO shards: each matrix's update computed once, by an owner rank (layer-wise).

State: a Muon matrix's momentum lives in its region's ``exp_avg`` shard (same place, same
checkpoint name as Adam's first moment); the region's ``exp_avg_sq`` becomes a
:class:`~.compact_moment.CompactMoment` that stores the AdamW ranges only (a checkpoint still
sees a shard-length vector, zero on the matrices). The momentum lerp and
the Nesterov blend are elementwise, so they run on each rank's shard (:func:`momentum_input`);
only the Newton-Schulz input U needs the whole matrix. Per step, for the matrices of the
regions sharded over one group (``dp``, or ``edp`` for routed experts), with N members:

* owners: whole matrices are dealt to the N ranks, largest first to the least loaded (balanced
  by elements, the same on every rank); rank d's k-th matrix is its matrix of *round* k;
* per round: every rank sends its piece of U of each round-k matrix to that matrix's owner
  (point-to-point, exactly the piece: volume n per matrix); the owner, holding the whole
  TP-local U, all-gathers it over the matrix's TP group when TP-split (``--muon-tp-mode
  duplicated``: the whole matrix, exact), runs NS once, keeps its TP slice, and sends each rank
  back its piece of the update (volume n); everyone applies ``W <- W (1 - lr wd) - lr O`` to
  its master shard.

Memory: besides its shard of momentum, a rank holds its own round's whole U and update (one
matrix in flight; two with TP: the gathered full matrix and its update). Stage 0 (nothing
sharded): every rank holds every U already and computes each matrix itself (no DP traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.optim.muon import MuonSettings, apply_update, momentum_input, orthogonalize

from .compact_moment import CompactMoment


@dataclass(frozen=True)
class MuonMatrix:
    """What ZeRO needs to know about one Muon matrix beyond its place in a region: ``split`` (an
    object with ``to_full(pieces)`` / ``to_local(full, tp_rank, tp)``, e.g. a TPSplit; None when
    replicated over TP), ``tp_group`` (None: not split), ``row_blocks`` (full-matrix row blocks
    orthogonalized separately: ``--muon-split-qkv``)."""

    split: object = None
    tp_group: object = None
    row_blocks: tuple | None = None


@dataclass
class _Entry:
    region: int
    param: torch.nn.Parameter
    offset: int
    info: MuonMatrix
    owner: int = 0


def _overlap(lo, hi, a, b):
    return max(lo, a), min(hi, b)


class MuonShards:
    """The Muon half of a :class:`~.optimizer.ZeroOptimizer`'s step (module docstring).
    ``matrices``: ``{param: MuonMatrix}`` of the Muon parameters (others step with AdamW)."""

    def __init__(self, regions, comm, settings: MuonSettings, matrices: dict):
        self.settings, self.comm = settings, comm
        by_id = {id(p): info for p, info in matrices.items()}
        self.entries: list[_Entry] = []
        for i, r in enumerate(regions):
            for p, o in zip(r.params, r.offsets):
                if id(p) in by_id:
                    self.entries.append(_Entry(i, p, o, by_id[id(p)]))
        groups: dict = {}
        for e in self.entries:
            groups.setdefault(regions[e.region].group, []).append(e)
        self.rounds = {name: self._deal(es, comm.groups[name][1]) for name, es in groups.items()}
        self.ranges = [self._shard_ranges(r, i) for i, r in enumerate(regions)]
        for r, muon in zip(regions, self.ranges):  # no second moment on the Muon matrices
            if muon:
                r.exp_avg_sq = CompactMoment(r.shard_len, _subtract([(0, r.shard_len)], muon), r.master.device,
                                             source=r.exp_avg_sq)

    @staticmethod
    def _deal(entries, n: int) -> list[list]:
        """Owners, balanced by elements (largest first to the least loaded rank; ties: lowest
        rank), and the rounds: ``rounds[k][d]`` the k-th matrix of rank d (or None)."""
        load, owned = [0] * n, [[] for _ in range(n)]
        for e in sorted(entries, key=lambda e: -e.param.numel()):  # stable: model order among equals
            d = min(range(n), key=lambda i: (load[i], i))
            e.owner = d
            load[d] += e.param.numel()
            owned[d].append(e)
        depth = max((len(o) for o in owned), default=0)
        return [[o[k] if k < len(o) else None for o in owned] for k in range(depth)]

    def _shard_ranges(self, region, i: int) -> list:
        """The shard-relative ``[a, b)`` ranges of region ``i`` that Muon steps."""
        lo, hi = region.shard_lo, region.shard_lo + region.shard_len
        out = []
        for e in self.entries:
            if e.region == i:
                a, b = _overlap(lo, hi, e.offset, e.offset + e.param.numel())
                if a < b:
                    out.append((a - lo, b - lo))
        return out

    def adam_ranges(self, per_region) -> list:
        """``per_region`` (per region, ``[a, b)`` shard ranges) minus the Muon ranges."""
        return [_subtract(rr, mr) for rr, mr in zip(per_region, self.ranges)]

    @torch.no_grad()
    def step(self, regions, grads, *, lr: float, weight_decay: float) -> None:
        """Momentum on the shards, NS once per matrix on its owner, the update on the shards."""
        pieces = []  # (entry, a, b): this rank's piece [a, b) of the matrix (relative to it)
        for e in self.entries:
            r = regions[e.region]
            lo = r.shard_lo
            a, b = _overlap(lo, lo + r.shard_len, e.offset, e.offset + e.param.numel())
            if a < b:
                pieces.append((e, a - e.offset, b - e.offset))
        views = {id(e): (regions[e.region], a, b) for e, a, b in pieces}

        def sl(t, e):
            r, a, b = views[id(e)]
            return t[e.offset + a - r.shard_lo:e.offset + b - r.shard_lo]
        us = momentum_input([sl(grads[e.region], e) for e, _, _ in pieces],
                            [sl(regions[e.region].exp_avg, e) for e, _, _ in pieces],
                            [sl(regions[e.region].master, e) for e, _, _ in pieces], self.settings, weight_decay)
        u_of = {id(e): u for (e, _, _), u in zip(pieces, us)}
        upd_of = {id(e): torch.empty_like(u) for (e, _, _), u in zip(pieces, us)}
        for name, rounds in self.rounds.items():
            group, size, rank = self.comm.groups[name]
            for row in rounds:
                self._round(regions, row, group, size, rank, u_of, upd_of, views)
        ps = [sl(regions[e.region].master, e) for e, _, _ in pieces]
        apply_update(ps, [upd_of[id(e)] for e, _, _ in pieces], lr, weight_decay, self.settings.decoupled)

    def _round(self, regions, row, group, size, rank, u_of, upd_of, views) -> None:
        """One round: gather each round matrix's U to its owner, orthogonalize there, send the
        pieces of the update back. Stage 0 (a region kept whole): every rank does every matrix."""
        for e in row:
            if e is not None and regions[e.region].stage == 0:
                full = u_of[id(e)].view(e.param.shape)
                upd_of[id(e)].copy_(self._orthogonalize(full, e).reshape(-1))
        row = [e for e in row if e is not None and regions[e.region].stage >= 1]
        if not row:
            return
        mine = next((e for e in row if e.owner == rank), None)
        full_u = None if mine is None else torch.empty(mine.param.numel(), dtype=torch.float32,
                                                      device=regions[mine.region].master.device)
        self._exchange(row, group, size, rank, u_of, full_u, regions, gather=True)
        full_o = None
        if mine is not None:
            full_o = self._orthogonalize(full_u.view(mine.param.shape), mine).reshape(-1)
        self._exchange(row, group, size, rank, upd_of, full_o, regions, gather=False)

    def _exchange(self, row, group, size, rank, local, full, regions, gather: bool) -> None:
        """Point-to-point: each rank's piece of each matrix to (gather) or from (scatter) its
        owner; the owner's own piece is a local copy."""
        ops = []
        for e in row:
            r = regions[e.region]
            n = e.param.numel()
            for d in range(size):
                a, b = _overlap(d * r.shard_len, (d + 1) * r.shard_len, e.offset, e.offset + n)
                if a >= b or (d != rank and e.owner != rank):
                    continue
                a, b = a - e.offset, b - e.offset
                if d == rank and e.owner == rank:
                    (full[a:b].copy_(local[id(e)]) if gather else local[id(e)].copy_(full[a:b]))
                elif d == rank:  # my piece, to or from the owner
                    peer = dist.get_global_rank(group, e.owner)
                    ops.append(dist.P2POp(dist.isend if gather else dist.irecv, local[id(e)], peer))
                else:  # I own it: rank d's piece
                    peer = dist.get_global_rank(group, d)
                    ops.append(dist.P2POp(dist.irecv if gather else dist.isend, full[a:b], peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _orthogonalize(self, u: torch.Tensor, e: _Entry) -> torch.Tensor:
        """s * NS of the whole matrix (TP pieces gathered when split), this TP rank's slice."""
        info = e.info
        tp = dist.get_world_size(info.tp_group) if info.tp_group is not None else 1
        if info.split is None or tp == 1:
            return orthogonalize(u, self.settings, info.row_blocks)
        pieces = [torch.empty_like(u) for _ in range(tp)]
        dist.all_gather(pieces, u.contiguous(), group=info.tp_group)
        full = orthogonalize(info.split.to_full(pieces), self.settings, info.row_blocks)
        return info.split.to_local(full, dist.get_rank(info.tp_group), tp).contiguous()


def _subtract(ranges, cut) -> list:
    """``[a, b)`` ranges minus the ``cut`` ranges (both sorted, disjoint)."""
    out = []
    for a, b in ranges:
        pos = a
        for c, d in cut:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out
