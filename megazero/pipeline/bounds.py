"""Warm-up counts and activation-memory bounds of the schedules (closed forms, no simulation).

Chunk-activations: a micro-batch's activation on one chunk (``1/VP`` of a stage's), live from its
forward to its backward, or to its weight gradient (``W``) when the backward is split. The
zero-bubble bounds are the simulator's peaks (``megazero.pipeline.simulate``: checked on a grid
of PP, VP, M in tests/pipeline/test_plan_zero_bubble.py).
"""

from __future__ import annotations


def warmup_count(pp: int, vp: int, m: int, rank: int) -> int:
    """Forwards (chunk-forwards with VP > 1) a rank runs before its first backward (1F1B and
    interleaved 1F1B)."""
    if pp == 1:
        return 0
    if vp == 1:
        return min(pp - rank - 1, m)
    if m == pp:  # Megatron: with M == PP every rank runs all its forwards first
        return m * vp
    return min(2 * (pp - rank - 1) + (vp - 1) * pp, m * vp)


def in_flight_bound(pp: int, vp: int, m: int, rank: int, schedule: str | None = None) -> int:
    """Most chunk-activations held at once on ``rank``.

    1F1B / interleaved 1F1B: warm-up + 1, at most ``M VP``. ``zb-h1``: ``min(PP, M)`` on every
    rank (1F1B's rank-0 peak everywhere). ``interleaved-zb``: ``min((VP - 1) Q + PP, M VP)`` with
    ``Q = M / max(1, M // PP)``. ``zbv``: ``min(2 PP, M + rank + 1, 2 M)`` (``PP`` stages' worth
    once ``M >= 2 PP - 1``). ``dualpipev``: ``2 PP + 1`` (``M >= 2 PP``).
    """
    if pp == 1 and schedule in (None, "1f1b"):
        return 1
    if schedule == "zb-h1":
        return min(pp, m)
    if schedule == "interleaved-zb":
        return min((vp - 1) * (m // max(1, m // pp)) + pp, m * vp)
    if schedule == "zbv":
        return min(2 * pp, m + rank + 1, 2 * m)
    if schedule == "dualpipev":
        return min(2 * pp + 1, 2 * m)
    return min(warmup_count(pp, vp, m, rank) + 1, m * vp)
