"""Pipeline schedules as explicit per-rank action lists, built and checked without processes.

A *plan* is the list of actions one pipeline rank executes in one training step:

* ``Action("F", m, c)`` -- forward of micro-batch ``m`` on this rank's model chunk ``c``;
* ``Action("B", m, c)`` -- backward of the same: the full backward, or -- when the plan also
  holds ``Action("W", m, c)`` -- only the gradient of the chunk's input (what the previous
  stage waits for), saving what the weight gradient needs (:func:`split_backwards`);
* ``Action("W", m, c)`` -- the deferred weight gradient of that B (zero-bubble schedules): no
  communication, always after its B;
* ``Action("COMM", ops=...)`` -- one batched point-to-point exchange (``batch_isend_irecv``) of
  :class:`P2P` sends/receives with the neighbouring stages; its *receives* are waited on before
  the next action, its sends may complete in the background (waited on, at the latest, when the
  step ends; the zero-bubble plans deadlock if a COMM also waits for its sends' receives --
  :func:`~.simulate.simulate` checks both models).  An op whose ``peer`` is the rank itself is a
  hand-over between two chunks of the rank (the V's turn): no process communication.

Chunk ``c`` of pipeline rank ``r`` is *virtual stage* ``s`` of ``S = PP * VP``: ``s = c * PP + r``
(Megatron's interleaved "loop" order) or, for ``zbv``/``dualpipev``, the V (chunk 0 = stage
``r``, chunk 1 = stage ``2 PP - 1 - r``; :func:`megazero.parallel.layout.stage_of_chunk`).  Stage
``s > 0`` receives its input activation from the rank holding stage ``s - 1`` and sends back the
gradient of that input; stage ``s < S - 1`` sends its output and receives the output's gradient.
In the V the second chunk's neighbours go *backwards* through the ranks, and the turn
(stage ``PP - 1`` -> ``PP``, both on rank ``PP - 1``) is a hand-over inside the rank: its ops
carry ``peer`` equal to the rank itself and move no data between processes.
Communication is derived from the compute order: the sends produced by one compute and the
receives needed by the next are batched together (Megatron's ``send_forward_recv_backward``
and friends), so with 1F1B every COMM holds at most one send and one receive.  Receives are
posted in each channel's send order (a message needed later than one sent after it is received
early and kept), as NCCL and gloo match a pair's messages in order.

Schedules (``M`` micro-batches, ``t_f``/``t_b`` the forward/backward time of a whole stage):

* **no pipelining** (PP = 1): ``F0 B0 F1 B1 ...`` -- gradient accumulation, no bubble.
* **1F1B** (``1f1b``: PP > 1, VP = 1): warm-up of ``PP - r - 1`` forwards, then one-forward-one-backward,
  then a cool-down of the remaining backwards.  Bubble ``(PP - 1)(t_f + t_b)`` per step, i.e. a
  bubble fraction of ``(PP - 1) / M`` of the ideal time; at most ``min(PP - r, M)`` micro-batches
  are in flight (forwarded, not yet backwarded) on rank ``r``.
* **interleaved 1F1B** (``interleaved-1f1b``: PP > 1, VP > 1, ``M % PP == 0``): forwards walk ``PP`` micro-batches
  at a time through chunk 0, then chunk 1, ...; backwards walk the chunks in reverse.  Warm-up
  is ``2 (PP - r - 1) + (VP - 1) PP`` chunk-forwards (capped at ``M VP``).  Bubble
  ``(PP - 1)(t_f + t_b) / VP``, fraction ``(PP - 1) / (VP M)``; at most ``warm-up + 1``
  chunk-activations (each ``1/VP`` of a stage's) are in flight.
* **zero bubble** (``zb-h1``, ``interleaved-zb``, ``zbv``, ``dualpipev``): :mod:`.zero_bubble`.

:func:`simulate` executes all ranks' plans together -- by default with the runner's semantics
(receives waited, sends completing in the background); ``comm="rendezvous"`` or ``"nccl"`` for
stricter models (:mod:`.streams`) -- to prove the plans cannot deadlock, that every channel's
sends and receives match one for one in order, and to count idle time.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.parallel.layout import chunk_placement, rank_of_stage, stage_of_chunk

from .bounds import in_flight_bound, warmup_count  # noqa: F401  (re-exported, as before the split)
from .simulate import simulate  # noqa: F401  (re-exported: plan.simulate, as before the split)
from .zero_bubble import dualpipev_order, zb1p_order, zbv_order

# name -> (chunks per rank: "1", ">1" or "2"; chunk placement)
SCHEDULES = {"1f1b": ("1", "loop"), "interleaved-1f1b": (">1", "loop"), "zb-h1": ("1", "loop"),
             "interleaved-zb": (">1", "loop"), "zbv": ("2", "v"), "dualpipev": ("2", "v")}


@dataclass(frozen=True)
class P2P:
    """One send or receive.  ``what`` is ``"act"`` (activation, forward direction) or ``"grad"``.

    ``chunk`` is this rank's chunk whose input (recv act / send grad) or output (send act /
    recv grad) travels; ``peer`` is the neighbour's pipeline rank; ``stage`` is the virtual
    stage on the *receiving* side, so a send and its receive carry the same ``key``.
    """

    op: str  # "send" | "recv"
    what: str  # "act" | "grad"
    mb: int
    chunk: int
    peer: int
    stage: int

    @property
    def key(self) -> tuple:
        return (self.what, self.mb, self.stage)

    def __str__(self) -> str:
        arrow = "->" if self.op == "send" else "<-"
        return f"{self.op} {self.what} m{self.mb}c{self.chunk}{arrow}r{self.peer}"


@dataclass(frozen=True)
class Action:
    kind: str  # "F" | "B" | "W" | "COMM"
    mb: int = -1
    chunk: int = -1
    ops: tuple = ()

    def __str__(self) -> str:
        if self.kind == "COMM":
            return "[" + ", ".join(str(o) for o in self.ops) + "]"
        return f"{self.kind}{self.mb}.{self.chunk}"


def _check(pp: int, vp: int, m: int, rank: int, schedule: str | None = None) -> str:
    """The schedule name for this shape (default: ``1f1b`` / ``interleaved-1f1b`` by VP), after
    checking that the shape suits it; ``ValueError`` names what does not fit."""
    if pp < 1 or vp < 1 or m < 1 or not 0 <= rank < pp:
        raise ValueError(f"bad schedule shape: PP {pp}, VP {vp}, M {m}, rank {rank}")
    if pp == 1 and vp > 1:
        raise ValueError("virtual pipeline stages (VP > 1) need PP > 1")
    name = schedule or ("1f1b" if vp == 1 else "interleaved-1f1b")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    need = SCHEDULES[name][0]
    if (need == "1" and vp != 1) or (need == ">1" and vp < 2) or (need == "2" and vp != 2):
        what = {"1": "no virtual stages (VP 1)", ">1": "virtual stages (VP > 1)", "2": "exactly 2 chunks per rank"}
        raise ValueError(f"pipeline schedule {name} needs {what[need]}, got VP {vp}")
    if name == "interleaved-1f1b" and m % pp:
        raise ValueError(f"interleaved 1F1B needs the number of micro-batches ({m}) to be a multiple of PP ({pp})")
    return name


def placement(schedule: str | None) -> str:
    """``"v"`` for the V-shaped schedules (zbv, dualpipev), else ``"loop"``."""
    return chunk_placement(schedule)


def schedule_name(pp: int, vp: int, schedule: str | None = None) -> str:
    """``no-pipelining`` with PP = 1 (1F1B's default), else the schedule's name."""
    if pp == 1 and schedule in (None, "1f1b"):
        return "no-pipelining"
    return schedule or ("1f1b" if vp == 1 else "interleaved-1f1b")


def theoretical_bubble(pp: int, vp: int, m: int, schedule: str | None = None) -> float:
    """Bubble time over ideal (busy) time at ``t_f = t_b = t_w``: ``(PP - 1) / (VP M)`` for 1F1B and
    interleaved 1F1B; for the zero-bubble schedules the simulator's closed forms where the pipeline
    is full -- ZB-H1 ``(PP - 1) / (3 M)`` (M >= PP), interleaved ZB ``(PP - 1) / (3 VP M)``
    (M >= PP), ZBV ``(PP - 1) / (6 M)`` (M >= 2 PP), DualPipeV as megazero runs it (no F/B overlap)
    ``(PP - 1) / (3 M)`` -- and the simulator itself otherwise."""
    name = schedule_name(pp, vp, schedule)
    if name in ("1f1b", "interleaved-1f1b", "no-pipelining"):
        return (pp - 1) / (vp * m)
    full = {"zb-h1": (m >= pp, 3 * m), "interleaved-zb": (m >= pp, 3 * vp * m), "zbv": (m >= 2 * pp, 6 * m),
            "dualpipev": (True, 3 * m)}[name]
    if full[0]:
        return (pp - 1) / full[1]
    res = simulate([build_plan(pp, vp, m, r, schedule=name) for r in range(pp)], 1.0, 1.0, 1.0)
    return sum(res["idle"]) / sum(res["busy"])


def compute_steps(pp: int, vp: int, m: int, rank: int, schedule: str | None = None) -> list[list[tuple[str, int, int]]]:
    """The compute sequence of ``rank`` as steps of (kind, micro-batch, chunk).

    Communication happens only between steps.  1F1B and no pipelining: one compute per step.
    Interleaved: warm-up steps ``[F]``, steady steps ``[F, B]`` (run back to back, as Megatron
    does), cool-down steps ``[B]``.  Zero-bubble schedules: :mod:`.zero_bubble`.
    """
    name = _check(pp, vp, m, rank, schedule)
    if name in ("zb-h1", "interleaved-zb"):
        return zb1p_order(pp, vp, m, rank)
    if name == "zbv":
        return zbv_order(pp, m, rank)
    if name == "dualpipev":
        return dualpipev_order(pp, m, rank)
    total = m * vp

    def fwd(k):  # k-th chunk-forward -> (micro-batch, chunk)
        group, within = divmod(k, pp * vp)
        return group * pp + within % pp, within // pp

    def bwd(k):
        mb, c = fwd(k)
        return mb, vp - 1 - c

    if pp == 1:
        return [[(kind, i, 0)] for i in range(m) for kind in "FB"]
    w = warmup_count(pp, vp, m, rank)
    steps = [[("F", *fwd(k))] for k in range(w)]
    for i in range(total - w):
        pair = [("F", *fwd(w + i)), ("B", *bwd(i))]
        steps += [pair] if vp > 1 else [[pair[0]], [pair[1]]]
    steps += [[("B", *bwd(k))] for k in range(total - w, total)]
    return steps


def compute_order(pp: int, vp: int, m: int, rank: int, schedule: str | None = None) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) compute sequence of ``rank`` (see module docstring)."""
    return [a for step in compute_steps(pp, vp, m, rank, schedule) for a in step]


def split_backwards(plan: list[Action]) -> set[tuple[int, int]]:
    """``{(micro-batch, chunk)}`` whose B computes only the input gradient (the plan has its W)."""
    return {(a.mb, a.chunk) for a in plan if a.kind == "W"}


def _p2p(pp: int, vp: int, where: str):
    """``(before, after)``: the receives a compute of ``rank`` needs first and the sends it makes
    after, as :class:`P2P` ops (``before(rank, kind, mb, chunk)``)."""
    stages = pp * vp

    def op(kind, what, mb, c, peer_stage, key_stage):
        return P2P(kind, what, mb, c, rank_of_stage(pp, peer_stage, where)[0], key_stage)

    def before(rank, kind, mb, c):
        s = stage_of_chunk(pp, vp, rank, c, where)
        if kind == "F" and s > 0:
            return [op("recv", "act", mb, c, s - 1, s)]
        if kind == "B" and s < stages - 1:
            return [op("recv", "grad", mb, c, s + 1, s)]
        return []

    def after(rank, kind, mb, c):
        s = stage_of_chunk(pp, vp, rank, c, where)
        if kind == "F" and s < stages - 1:
            return [op("send", "act", mb, c, s + 1, s + 1)]
        if kind == "B" and s > 0:
            return [op("send", "grad", mb, c, s - 1, s - 1)]
        return []

    return before, after


def _incoming(pp, vp, rank, steps_of, where, after) -> dict[int, list[P2P]]:
    """``{sender rank: the receives of ``rank`` from it, in the sender's send order}`` -- the
    order a channel delivers in (a receive posted out of that order would get the wrong data)."""
    out: dict[int, list[P2P]] = {}
    for q in range(pp):
        for step in steps_of(q):
            for a in step:
                for op in after(q, *a):
                    if op.peer == rank:
                        c = rank_of_stage(pp, op.stage, where)[1]
                        out.setdefault(q, []).append(P2P("recv", op.what, op.mb, c, q, op.stage))
    return out


def plan_from_steps(pp: int, vp: int, rank: int, steps_of, where: str = "loop") -> list[Action]:
    """``rank``'s action list for any compute orders: ``steps_of(q)`` gives rank ``q``'s steps
    (lists of ``(kind, micro-batch, chunk)``), ``where`` the chunk placement.  Each COMM holds the
    sends of the step before and the receives of the step after.  Receives follow each channel's
    send order: when a compute needs a message that its sender sent after others still
    unreceived, those are received (and kept) in the same COMM."""
    before, after = _p2p(pp, vp, where)
    incoming = _incoming(pp, vp, rank, steps_of, where, after)
    taken = {q: 0 for q in incoming}
    index = {q: {op: i for i, op in enumerate(chan)} for q, chan in incoming.items()}
    plan: list[Action] = []
    pending: list[P2P] = []
    for step in steps_of(rank):
        recvs = []
        for op in (op for a in step for op in before(rank, *a)):
            upto = max(taken[op.peer], index[op.peer][op] + 1)  # already received early: nothing
            recvs += incoming[op.peer][taken[op.peer]:upto]
            taken[op.peer] = upto
        if recvs or pending:
            plan.append(Action("COMM", ops=tuple(pending + recvs)))
            pending = []
        plan += [Action(*a) for a in step]
        pending += [op for a in step for op in after(rank, *a)]
    if pending:
        plan.append(Action("COMM", ops=tuple(pending)))
    return plan


def build_plan(pp: int, vp: int, m: int, rank: int, forward_only: bool = False,
               schedule: str | None = None) -> list[Action]:
    """The action list of pipeline rank ``rank``: computes with COMM batches in between
    (:func:`plan_from_steps`).

    ``schedule``: a name of :data:`SCHEDULES` (default ``1f1b`` with VP = 1, else
    ``interleaved-1f1b``).  With ``forward_only`` the backwards and weight gradients (and
    gradient traffic) are dropped and the forwards keep the schedule's order.
    """
    orders: dict[int, list] = {}

    def steps_of(q):
        if q not in orders:
            steps = compute_steps(pp, vp, m, q, schedule)
            if forward_only:
                steps = [step for step in ([a for a in st if a[0] == "F"] for st in steps) if step]
            orders[q] = steps
        return orders[q]

    return plan_from_steps(pp, vp, rank, steps_of, placement(schedule))


def format_plan(plan: list[Action]) -> str:
    return " ".join(str(a) for a in plan)


