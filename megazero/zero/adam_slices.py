"""AdamW over a rank's shards in pieces of bounded size (the temporaries of one piece only)."""

from __future__ import annotations

import torch

ADAM_SLICE = 1 << 24  # elements per AdamW call on an accelerator: its temporaries stay <= 64 MB
HOST_ADAM_SLICE = 1 << 18  # on the CPU: 1 MiB temporaries, reused from the heap and warm in cache


def adam_slice(device) -> int:
    """Elements per AdamW call on ``device``. On the CPU the update's seven elementwise passes
    over a 1 MiB piece stay in the core's cache and its temporary is reused, where one call over
    a whole 4.2 M-element shard streams every pass from memory into a fresh 17 MB block (measured:
    10.2 -> 8.4 ms per update, docs/benchmarks.md, issue 33); an accelerator keeps large calls
    (fewer kernel launches)."""
    return HOST_ADAM_SLICE if torch.device(device).type == "cpu" else ADAM_SLICE


def shard_slices(regions, grads, size: int, ranges, decay_all: bool = False):
    """``adamw_step``'s positional lists and its ``decay_grads``, over consecutive pieces of about
    ``size`` elements of the regions' shards (``ranges``: per region, the ``[a, b)`` ranges to
    cover). AdamW is elementwise, so the pieces give the same bits as one call over everything,
    with temporaries of one piece instead of the whole shard. ``decay_all``: every piece takes
    weight decay (a user's param group with its own ``weight_decay``), not only the regions'
    matrix segments."""
    pieces = [(r, g, lo, min(lo + size, b)) for r, g, rr in zip(regions, grads, ranges) for a, b in rr
              for lo in range(a, b, size)]
    batch, n = [], 0
    for piece in pieces + [None]:
        if batch and (piece is None or n + piece[3] - piece[2] > size):
            yield adam_lists(batch, decay_all)
            batch, n = [], 0
        if piece is not None:
            batch.append(piece)
            n += piece[3] - piece[2]


def adam_lists(batch, decay_all: bool = False):
    """``((params, grads, exp_avgs, exp_avg_sqs, decay views), decay_grads)`` of
    ``[(region, grad, lo, hi)]``: shard pieces ``[lo, hi)`` and the decayed segments inside them
    (``decay_all``: the whole pieces)."""
    cut = [(r, g, lo, hi, [(lo, hi)] if decay_all else
            [(max(a, lo), min(b, hi)) for a, b in r.decay_segments if max(a, lo) < min(b, hi)])
           for r, g, lo, hi in batch]
    lists = ([r.master[lo:hi] for r, _, lo, hi, _ in cut], [g[lo:hi] for _, g, lo, hi, _ in cut],
             [r.exp_avg[lo:hi] for r, _, lo, hi, _ in cut], [r.exp_avg_sq[lo:hi] for r, _, lo, hi, _ in cut],
             [r.master[a:b] for r, _, _, _, segs in cut for a, b in segs])
    return lists, [g[a:b] for _, g, _, _, segs in cut for a, b in segs]

