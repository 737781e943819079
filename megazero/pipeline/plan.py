"""Pipeline schedules as explicit per-rank action lists, built and checked without processes.

A *plan* is the list of actions one pipeline rank executes in one training step:

* ``Action("F", m, c)`` -- forward of micro-batch ``m`` on this rank's model chunk ``c``;
* ``Action("B", m, c)`` -- backward of the same;
* ``Action("COMM", ops=...)`` -- one batched point-to-point exchange (``batch_isend_irecv``) of
  :class:`P2P` sends/receives with the neighbouring stages, waited on before the next action.

Chunk ``c`` of pipeline rank ``r`` is *virtual stage* ``s = c * PP + r`` of ``S = PP * VP``
(Megatron's interleaved order).  Stage ``s > 0`` receives its input activation from stage
``s - 1`` (pipeline rank ``(r - 1) % PP``, wrapping round for ``c > 0``) and sends back the
gradient of that input; stage ``s < S - 1`` sends its output and receives the output's gradient.
Communication is derived from the compute order: the sends produced by one compute and the
receives needed by the next are batched together (Megatron's ``send_forward_recv_backward``
and friends), so every COMM holds at most one send and one receive.

Schedules (``M`` micro-batches, ``t_f``/``t_b`` the forward/backward time of a whole stage):

* **no pipelining** (PP = 1): ``F0 B0 F1 B1 ...`` -- gradient accumulation, no bubble.
* **1F1B** (PP > 1, VP = 1): warm-up of ``PP - r - 1`` forwards, then one-forward-one-backward,
  then a cool-down of the remaining backwards.  Bubble ``(PP - 1)(t_f + t_b)`` per step, i.e. a
  bubble fraction of ``(PP - 1) / M`` of the ideal time; at most ``min(PP - r, M)`` micro-batches
  are in flight (forwarded, not yet backwarded) on rank ``r``.
* **interleaved 1F1B** (PP > 1, VP > 1, ``M % PP == 0``): forwards walk ``PP`` micro-batches
  at a time through chunk 0, then chunk 1, ...; backwards walk the chunks in reverse.  Warm-up
  is ``2 (PP - r - 1) + (VP - 1) PP`` chunk-forwards (capped at ``M VP``).  Bubble
  ``(PP - 1)(t_f + t_b) / VP``, fraction ``(PP - 1) / (VP M)``; at most ``warm-up + 1``
  chunk-activations (each ``1/VP`` of a stage's) are in flight.

:func:`simulate` executes all ranks' plans together with blocking rendezvous semantics (a send
completes only when its receive is posted) to prove the plans cannot deadlock, that every
channel's sends and receives match one for one in order, and to count idle time.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    kind: str  # "F" | "B" | "COMM"
    mb: int = -1
    chunk: int = -1
    ops: tuple = ()

    def __str__(self) -> str:
        if self.kind == "COMM":
            return "[" + ", ".join(str(o) for o in self.ops) + "]"
        return f"{self.kind}{self.mb}.{self.chunk}"


def _check(pp: int, vp: int, m: int, rank: int) -> None:
    if pp < 1 or vp < 1 or m < 1 or not 0 <= rank < pp:
        raise ValueError(f"bad schedule shape: PP {pp}, VP {vp}, M {m}, rank {rank}")
    if pp == 1 and vp > 1:
        raise ValueError("virtual pipeline stages (VP > 1) need PP > 1")
    if vp > 1 and m % pp:
        raise ValueError(f"interleaved 1F1B needs the number of micro-batches ({m}) to be a multiple of PP ({pp})")


def schedule_name(pp: int, vp: int) -> str:
    return "no-pipelining" if pp == 1 else ("1f1b" if vp == 1 else "interleaved-1f1b")


def warmup_count(pp: int, vp: int, m: int, rank: int) -> int:
    """Forwards (chunk-forwards with VP > 1) a rank runs before its first backward."""
    if pp == 1:
        return 0
    if vp == 1:
        return min(pp - rank - 1, m)
    if m == pp:  # Megatron: with M == PP every rank runs all its forwards first
        return m * vp
    return min(2 * (pp - rank - 1) + (vp - 1) * pp, m * vp)


def in_flight_bound(pp: int, vp: int, m: int, rank: int) -> int:
    """Most chunk-activations held at once on ``rank`` (warm-up + 1, at most ``M VP``)."""
    return min(warmup_count(pp, vp, m, rank) + 1, m * vp)


def theoretical_bubble(pp: int, vp: int, m: int) -> float:
    """Bubble time over ideal time: ``(PP - 1) / (VP M)``."""
    return (pp - 1) / (vp * m)


def compute_steps(pp: int, vp: int, m: int, rank: int) -> list[list[tuple[str, int, int]]]:
    """The compute sequence of ``rank`` as steps of (kind, micro-batch, chunk).

    Communication happens only between steps.  1F1B and no pipelining: one compute per step.
    Interleaved: warm-up steps ``[F]``, steady steps ``[F, B]`` (run back to back, as Megatron
    does), cool-down steps ``[B]``.
    """
    _check(pp, vp, m, rank)
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


def compute_order(pp: int, vp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) compute sequence of ``rank`` (see module docstring)."""
    return [a for step in compute_steps(pp, vp, m, rank) for a in step]


def build_plan(pp: int, vp: int, m: int, rank: int, forward_only: bool = False) -> list[Action]:
    """The action list of pipeline rank ``rank``: computes with COMM batches in between.

    With ``forward_only`` the backwards (and gradient traffic) are dropped and forwards run in
    order ``(m, chunk)`` chunk-major per group of PP micro-batches, as in training.
    """
    steps = compute_steps(pp, vp, m, rank)
    if forward_only:
        steps = [[a for a in step if a[0] == "F"] for step in steps]
        steps = [step for step in steps if step]
    stages = pp * vp
    prev_r, next_r = (rank - 1) % pp, (rank + 1) % pp

    def before(kind, mb, c):
        s = c * pp + rank
        if kind == "F" and s > 0:
            return [P2P("recv", "act", mb, c, prev_r, s)]
        if kind == "B" and s < stages - 1:
            return [P2P("recv", "grad", mb, c, next_r, s)]
        return []

    def after(kind, mb, c):
        s = c * pp + rank
        if kind == "F" and s < stages - 1:
            return [P2P("send", "act", mb, c, next_r, s + 1)]
        if kind == "B" and s > 0:
            return [P2P("send", "grad", mb, c, prev_r, s - 1)]
        return []

    plan: list[Action] = []
    pending: list[P2P] = []
    for step in steps:
        ops = pending + [op for a in step for op in before(*a)]
        if ops:
            plan.append(Action("COMM", ops=tuple(ops)))
        plan += [Action(*a) for a in step]
        pending = [op for a in step for op in after(*a)]
    if pending:
        plan.append(Action("COMM", ops=tuple(pending)))
    return plan


def format_plan(plan: list[Action]) -> str:
    return " ".join(str(a) for a in plan)


def _channel_positions(plans: list[list[Action]]) -> dict[tuple, int]:
    """``{(rank, action index, op index): position of the op in its channel's order}``, after
    checking that every channel ``src -> dst`` receives exactly the keys it sends, in order."""
    chan: dict[tuple, dict[str, list]] = {}
    pos: dict[tuple, int] = {}
    for r, plan in enumerate(plans):
        for i, a in enumerate(plan):
            for j, op in enumerate(a.ops):
                ch = (r, op.peer) if op.op == "send" else (op.peer, r)
                seq = chan.setdefault(ch, {"send": [], "recv": []})[op.op]
                pos[(r, i, j)] = len(seq)
                seq.append(op.key)
    for ch, seqs in chan.items():
        if seqs["send"] != seqs["recv"]:
            raise RuntimeError(f"channel r{ch[0]}->r{ch[1]}: sends {seqs['send']} != receives {seqs['recv']}")
    return pos


def simulate(plans: list[list[Action]], t_f: float = 1.0, t_b: float = 1.0) -> dict:
    """Run every rank's plan in lock-free lockstep; raise ``RuntimeError`` on any defect.

    Semantics: a rank's COMM posts all its ops at once and blocks until each has completed; an
    op completes when its counterpart (same channel ``src -> dst``, same position in that
    channel's order) has been posted -- rendezvous, the strictest model.  The counterpart must
    carry the same key ``(what, micro-batch, stage)``, or the data would be mismatched.  A forward
    takes ``t_f``, a backward ``t_b``; communication is free.

    Returns ``{"makespan", "busy": [...], "idle": [...], "max_in_flight": [...]}``.
    """
    pp = len(plans)
    pos = _channel_positions(plans)
    posted: dict[tuple, float] = {}  # (channel, op, position) -> post time
    pc, clock = [0] * pp, [0.0] * pp
    busy, live, peak = [0.0] * pp, [0] * pp, [0] * pp
    seen: list[set] = [set() for _ in range(pp)]
    while True:
        progressed = False
        for r in range(pp):
            while pc[r] < len(plans[r]):
                a = plans[r][pc[r]]
                if a.kind == "COMM":
                    keys = []
                    for j, op in enumerate(a.ops):
                        ch = (r, op.peer) if op.op == "send" else (op.peer, r)
                        k = (ch, op.op, pos[(r, pc[r], j)])
                        posted.setdefault(k, clock[r])
                        other = "recv" if op.op == "send" else "send"
                        keys.append((ch, other, k[2]))
                    if not all(k in posted for k in keys):
                        break
                    clock[r] = max([clock[r]] + [posted[k] for k in keys])
                else:
                    if a.kind == "B" and ("F", a.mb, a.chunk) not in seen[r]:
                        raise RuntimeError(f"rank {r}: backward of m{a.mb} chunk {a.chunk} before its forward")
                    if (a.kind, a.mb, a.chunk) in seen[r]:
                        raise RuntimeError(f"rank {r}: {a} runs twice")
                    seen[r].add((a.kind, a.mb, a.chunk))
                    dt = t_f if a.kind == "F" else t_b
                    clock[r] += dt
                    busy[r] += dt
                    live[r] += 1 if a.kind == "F" else -1
                    peak[r] = max(peak[r], live[r])
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(plans[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: str(plans[r][pc[r]]) for r in range(pp) if pc[r] < len(plans[r])}
            raise RuntimeError(f"deadlock: ranks blocked at {stuck}")
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy, "idle": [makespan - b for b in busy], "max_in_flight": peak}
