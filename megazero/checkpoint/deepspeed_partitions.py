"""DeepSpeed 0.19.8's ZeRO partitions of the engine's fp32 state, built from the engine's own
ZeRO shards by one ``all_to_all`` per region: nothing written twice, nothing gathered whole.

DeepSpeed's partition of an optimizer group (:mod:`megazero.checkpoint.deepspeed_files` has the
citations):

* ZeRO 1/2: the group's parameters one after the other in the group's order, padded to a
  multiple of ``2 * W`` (``nccl_start_alignment_factor * dp``), ``P = padded / W``; rank ``d``
  holds elements ``[d * P, (d + 1) * P)``, its moments over the whole ``P`` (zeros in the
  padding), its fp32 vector cut at the group's end (``_get_groups_without_padding``);
* ZeRO 3: every parameter of ``n`` elements in ``ceil(n / W)``-element pieces, rank ``d``
  holding piece ``d`` of each, one after the other (each piece ``q`` wide, zero-padded).

The engine's region ``k`` (a bucket or a stage-3 unit) is a flat vector of its parameters,
rank ``s`` holding ``[s L, (s + 1) L)`` (``L`` = ``shard_len``, the same on every rank). Every
rank computes the same list of transfers ``(s, d, group, place in d's partition, place in s's
shard, length)`` -- the overlap of what ``s`` holds of a parameter with what ``d`` needs of it
-- from the layout alone (no metadata exchanged), copies what it keeps, sends the rest of its rows
(``master``, ``exp_avg``, ``exp_avg_sq`` side by side) and places what it receives. Memory: this
rank's partitions (what it writes) plus one region's shard copied for sending.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

KINDS = ("master", "exp_avg", "exp_avg_sq")


def ranges(group, world: int, rank: int, stage3: bool):
    """``([(name, a, b, width)], padded length)``: the elements ``[a, b)`` of each parameter of
    ``group`` (``[(name, param)]``) rank ``rank``'s DeepSpeed partition holds, in its order
    (``width``: the room it takes there), and the partition's padded length."""
    if stage3:
        out = []
        for name, p in group:
            n = p.numel()
            q = math.ceil(n / world)
            out.append((name, min(rank * q, n), min((rank + 1) * q, n), q))
        return out, sum(q for *_, q in out)
    total = sum(p.numel() for _, p in group)
    part = math.ceil(total / (2 * world)) * 2
    lo, hi, out, o = rank * part, (rank + 1) * part, [], 0
    for name, p in group:
        a, b = max(o, lo), min(o + p.numel(), hi)
        if a < b:
            out.append((name, a - o, b - o, b - a))
        o += p.numel()
    return out, part


def _destinations(groups, world: int, stage3: bool) -> dict:
    """``name -> [(d, g, a, b, place)]``: rank ``d`` needs the parameter's ``[a, b)`` at ``place``
    of its partition of group ``g``."""
    dest = {}
    for d in range(world):
        for g, group in enumerate(groups):
            place = 0
            for name, a, b, width in ranges(group, world, d, stage3)[0]:
                dest.setdefault(name, []).append((d, g, a, b, place))
                place += width
    return dest


def _transfers(region: dict, dest: dict, world: int) -> list:
    """Every ``(s, d, g, place in d's partition, place in s's shard, length)`` of one region
    (``region``: its :meth:`describe`), in one order every rank computes alike."""
    step, out = region["shard_len"], []
    for name, o, n in region["params"]:
        for s in range(world):
            a_s, b_s = max(o, s * step) - o, min(o + n, (s + 1) * step) - o
            for d, g, a, b, place in dest.get(name, ()) if a_s < b_s else ():
                x, y = max(a, a_s), min(b, b_s)
                if x < y:
                    out.append((s, d, g, place + x - a, o + x - s * step, y - x))
    return out


def _exchange(shard: dict, moves: list, rank: int, world: int, out: list) -> None:
    """One region's exchange: what this rank keeps is copied in place; the rest of its rows of
    ``moves`` go out in one ``all_to_all``, what it receives is placed into ``out[g][kind]``."""
    for _, _, g, place, at, n in (m for m in moves if m[0] == rank == m[1]):
        for kind in KINDS:
            out[g][kind][place:place + n] = shard[kind][at:at + n].cpu()
    send = sorted((m for m in moves if m[0] == rank != m[1]), key=lambda m: m[1])  # stable: list order per d
    recv = sorted((m for m in moves if m[1] == rank != m[0]), key=lambda m: m[0])
    if world == 1:
        return
    rows = torch.stack([shard[k] for k in KINDS], 1) if send else shard["master"].new_empty(0, len(KINDS))
    buf = torch.cat([rows[m[4]:m[4] + m[5]] for m in send]) if send else rows
    got = rows.new_empty(sum(m[5] for m in recv), len(KINDS))
    dist.all_to_all_single(got, buf.contiguous(), [sum(m[5] for m in recv if m[0] == s) for s in range(world)],
                           [sum(m[5] for m in send if m[1] == d) for d in range(world)])
    got, i = got.cpu(), 0
    for _, _, g, place, _, n in recv:
        for k, kind in enumerate(KINDS):
            out[g][kind][place:place + n] = got[i:i + n, k]
        i += n


def partitions(zero, name_of: dict, groups: list, world: int, rank: int, stage3: bool) -> list:
    """``[(this rank's {master, exp_avg, exp_avg_sq} of group g (fp32, padded length), unpadded
    length)]`` per group (module doc). Collective over the engine's ranks (DP = the world)."""
    out, lengths = [], []
    for group in groups:
        held, length = ranges(group, world, rank, stage3)
        out.append({k: torch.zeros(length, dtype=torch.float32) for k in KINDS})
        lengths.append(length if stage3 else sum(b - a for _, a, b, _ in held))
    dest = _destinations(groups, world, stage3)
    for region, desc in zip(zero.regions, zero.layout(name_of)):
        if desc["shard_lo"] != rank * desc["shard_len"]:
            raise ValueError(f"engine.save_checkpoint(format='deepspeed'): region shard at {desc['shard_lo']} on DP "
                             f"rank {rank}, expected {rank * desc['shard_len']} (DeepSpeed's layout needs ZeRO 1-3)")
        _exchange(region.shard_state(copy=False), _transfers(desc, dest, world), rank, world, out)
    return list(zip(out, lengths))
