"""Compute orders of the zero-bubble schedules: ZB-H1, interleaved ZB, ZBV and DualPipeV.

Each backward is split into ``B`` (the input gradient, on the critical path: the previous
stage waits for it) and ``W`` (the weight gradient, needed only by the optimizer), after Qi et
al., "Zero Bubble Pipeline Parallelism" (2023, arXiv 2401.10241).  The W's move into the idle
slots that 1F1B leaves.  A ``B`` of a (micro-batch, chunk) that has no ``W`` in the plan is a
full backward (DualPipeV uses both kinds).  Orders are lists of *steps*, each a list of
``(kind, micro-batch, chunk)`` run back to back (communication only between steps); ``chunk``
is the rank-local chunk index (virtual stage: :func:`megazero.parallel.layout.stage_of_chunk`).

The orders are the ones ``torch.distributed.pipelining`` (torch 2.13) computes for the schedule
of the same name -- checked action for action in tests/pipeline/test_plan_zero_bubble.py:

* ``zb-h1`` / ``interleaved-zb`` (``ScheduleInterleavedZeroBubble``, the paper's ZB-H1 / ZB1P):
  with ``R = max(1, M // PP)`` rounds of ``Q = M / R`` micro-batches, warm-up of
  ``(VP - 1) Q + PP - 1 - r`` chunk-forwards (looped placement, chunk of the ``k``-th forward
  ``(k // Q) % VP``, backwards walk the chunks in reverse), then one F and one B each step;
  rank ``r`` holds its W's back by ``r`` backwards, so the cool-down's idle slots (1F1B's
  ``(PP - 1)(t_f + t_b + t_w)``) fill with W's: bubble ``(PP - 1)(t_f + t_b - 2 t_w)`` when
  ``t_w <= t_f``, about a third of 1F1B's with ``t_f = t_b = t_w``, at 1F1B's memory.
* ``zbv`` (``ScheduleZBVZeroBubble``, the paper's ZB-V): two chunks per rank in the V; the
  last rank starts its second chunk as soon as its first is done, so the only unavoidable idle
  time is the pipeline's fill of ``PP - 1`` forwards on chunk 0 and its drain.
* ``dualpipev`` (``ScheduleDualPipeV``, DeepSeek-V3's DualPipe cut in half): the V, with the
  steady state as pairs ``(F on one chunk, full B on the other)`` that DualPipe overlaps; the
  last ``r + 1`` backwards are split so their W's fill the drain.
"""

from __future__ import annotations


def zb1p_order(pp: int, vp: int, m: int, rank: int) -> list[list[tuple[str, int, int]]]:
    """``zb-h1`` (VP = 1) and ``interleaved-zb`` (VP > 1), looped placement (see module doc)."""
    rounds = max(1, m // pp)
    if vp > 1 and m % rounds:  # (with one chunk per rank the rounds change nothing)
        raise ValueError(f"interleaved-zb needs the number of micro-batches ({m}) to be a multiple of "
                         f"{rounds} (max(1, M // PP) rounds)")
    per_round, total = m // rounds, m * vp
    warmup = min((vp - 1) * per_round + pp - 1 - rank, total)
    seen: dict = {}

    def next_mb(kind, chunk):
        mb = seen.get((kind, chunk), 0)
        seen[(kind, chunk)] = mb + 1
        return mb

    def fwd(k):
        c = (k // per_round) % vp
        return ("F", next_mb("F", c), c)

    def bwd(i):
        c = vp - 1 - (i // per_round) % vp
        return ("B", next_mb("B", c), c)

    steps = [[fwd(k)] for k in range(warmup)]
    done_b: list[tuple[int, int]] = []  # (mb, chunk) of the backwards so far, in order
    n_w = 0
    for i in range(total):
        if warmup + i < total:
            steps.append([fwd(warmup + i)])
        b = bwd(i)
        steps.append([b])
        done_b.append(b[1:])
        if i >= rank:  # rank r keeps r weight gradients in hand
            steps.append([("W", *done_b[n_w])])
            n_w += 1
    steps += [[("W", *mc)] for mc in done_b[n_w:]]
    return steps


def zbv_order(pp: int, m: int, rank: int) -> list[list[tuple[str, int, int]]]:
    """``zbv``: V placement, chunk 0 = stage ``rank``, chunk 1 = stage ``2 PP - 1 - rank``."""
    n = max(2 * pp - 1, m)  # built for at least 2 PP - 1 micro-batches, the extra ones dropped
    cnt = {k: 0 for k in ("F0", "F1", "B0", "B1", "W0", "W1")}
    out: list[tuple[str, int, int]] = []

    def emit(kind, c):
        key = f"{kind}{c}"
        out.append((kind, cnt[key], c))
        cnt[key] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit("F", 0)
    for _ in range(rank):
        emit("F", 1), emit("F", 0)
    for _ in range(pp - rank):
        emit("F", 1), emit("B", 1), emit("W", 1)
    while cnt["F1"] < cnt["F0"] or cnt["F0"] < n:
        if cnt["F0"] < n:
            emit("F", 0)
        emit("B", 0), emit("W", 0), emit("F", 1), emit("B", 1), emit("W", 1)
    for _ in range(rank):
        emit("B", 0), emit("B", 1)
    for _ in range(pp - rank):
        emit("B", 0), emit("W", 0)
    while cnt["W1"] < cnt["B1"]:
        emit("W", 1)
    while cnt["W0"] < cnt["B0"]:
        emit("W", 0)
    return [[a] for a in out if a[1] < m]


def dualpipev_order(pp: int, m: int, rank: int) -> list[list[tuple[str, int, int]]]:
    """``dualpipev``: V placement; a step ``[F on one chunk, full B on the other]`` is one of
    DualPipe's overlapped pairs (megazero runs the two back to back, see docs/pipeline.md)."""
    if m < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 x PP = {2 * pp} micro-batches, got {m}")
    cnt: dict = {}
    weights: list[tuple[int, int]] = []  # split backwards whose W is still to run
    steps: list[list[tuple[str, int, int]]] = []

    def act(kind, c, split=False):
        key = (kind, c)
        mb = cnt.get(key, 0)
        cnt[key] = mb + 1
        if split:
            weights.append((mb, c))
        return (kind, mb, c)

    def weight():
        if weights:
            steps.append([("W", *weights.pop(0))])

    steps += [[act("F", 0)] for _ in range(2 * (pp - rank - 1))]
    for _ in range(rank + 1):
        steps += [[act("F", 0)], [act("F", 1)]]
    for _ in range(pp - rank - 1):
        steps.append([act("B", 1, split=True)])
        weight()
        steps.append([act("F", 1)])
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:  # not overlapped: the turn of the V needs F0's output first
            steps += [[act("F", 0)], [act("B", 1)]]
        else:
            steps.append([act("F", 0), act("B", 1)])
        steps.append([act("F", 1), act("B", 0)])
    for _ in range(pp - rank - 1):
        steps += [[act("B", 1)], [act("F", 1), act("B", 0)]]
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        steps.append([act("B", 1, split)])
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        steps.append([act("B", 0, split)])
    for _ in range(pp - rank - 1):
        weight()
        steps.append([act("B", 0, split)])
    for _ in range(rank + 1):
        weight()
    return steps
