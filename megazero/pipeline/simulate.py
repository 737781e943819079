"""The deadlock simulator: all ranks' plans run together, in simulated time, without processes.

:func:`simulate` executes every rank's plan (:mod:`.plan`) -- receives block until their send is
posted, sends complete in the background (``comm="eager"``), or a COMM also waits for its sends'
receives (``"rendezvous"``: one coalesced batch waited whole), or first NCCL's stream model of
the communicator's posting (``"nccl"``, :mod:`.streams`) -- to prove the plans cannot deadlock,
that every channel's sends and receives match one for one in order, that every F, B and W runs once
(B after its F, W after its B), and to count idle time and live activations.  A hand-over
inside a rank (``peer`` = the rank itself: the turn of the V) completes at once; its receive
needs the send posted before or in the same COMM.
"""

from __future__ import annotations

from .streams import channel_positions, check_streams


class _Rank:
    """One rank's progress: clock, busy time, live activations, what has run."""

    def __init__(self, plan):
        self.plan, self.pc, self.clock, self.busy = plan, 0, 0.0, 0.0
        self.split = {(a.mb, a.chunk) for a in plan if a.kind == "W"}
        self.live = self.peak = 0
        self.seen: set = set()
        self.timeline: list[tuple[float, float, str]] = []

    def compute(self, r, a, t_f, t_b, t_w) -> None:
        """Run F/B/W ``a``: check its order, advance the clock, count the live activations (a
        micro-batch's chunk-activation lives from its F to its W, or to its B when not split)."""
        key = (a.kind, a.mb, a.chunk)
        if key in self.seen:
            raise RuntimeError(f"rank {r}: {a} runs twice")
        need = {"B": "F", "W": "B"}.get(a.kind)
        if need and (need, a.mb, a.chunk) not in self.seen:
            raise RuntimeError(f"rank {r}: {a} before its {need}")
        self.seen.add(key)
        split = (a.mb, a.chunk) in self.split
        dt = {"F": t_f, "B": t_b if split else t_b + t_w, "W": t_w}[a.kind]
        self.timeline.append((self.clock, self.clock + dt, f"{a.kind if a.chunk < 1 else a.kind.lower()}{a.mb}"))
        self.clock += dt
        self.busy += dt
        if a.kind == "F":
            self.live += 1
        elif a.kind == "W" or not split:
            self.live -= 1
        self.peak = max(self.peak, self.live)


def _try_comm(r, st, a, pos, posted, rendezvous) -> bool:
    """Post COMM ``a`` of rank ``r``; complete it (advance the clock) when every receive has its
    send posted (and, ``rendezvous``, every send its receive; a hand-over inside the rank never
    waits for its receive)."""
    keys = []
    for j, op in enumerate(a.ops):
        ch = (r, op.peer) if op.op == "send" else (op.peer, r)
        k = (ch, op.op, pos[(r, st.pc, j)])
        posted.setdefault(k, st.clock)
        if op.op == "send" and (op.peer == r or not rendezvous):
            continue
        keys.append((ch, "recv" if op.op == "send" else "send", k[2]))
    if not all(k in posted for k in keys):
        return False
    st.clock = max([st.clock] + [posted[k] for k in keys])
    return True


COMMS = ("eager", "rendezvous", "nccl")


def _run(plans, pos, rendezvous, times) -> list:
    """Advance every rank as far as its COMMs allow, round after round, until all plans are done
    (the ranks' final states) or a round moves none (a deadlock: ``RuntimeError``)."""
    posted: dict[tuple, float] = {}  # (channel, op, position) -> post time
    ranks = [_Rank(p) for p in plans]
    while True:
        progressed = False
        for r, st in enumerate(ranks):
            while st.pc < len(st.plan):
                a = st.plan[st.pc]
                if a.kind == "COMM":
                    if not _try_comm(r, st, a, pos, posted, rendezvous):
                        break
                else:
                    st.compute(r, a, *times)
                st.pc += 1
                progressed = True
        if all(st.pc == len(st.plan) for st in ranks):
            return ranks
        if not progressed:
            stuck = {r: str(st.plan[st.pc]) for r, st in enumerate(ranks) if st.pc < len(st.plan)}
            raise RuntimeError(f"deadlock: ranks blocked at {stuck}")


def simulate(plans, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 0.0, rendezvous: bool = False,
             comm: str = "eager") -> dict:
    """Run every rank's plan in lock-free lockstep; raise ``RuntimeError`` on any defect.

    ``comm`` (one of :data:`COMMS`): ``"eager"`` the semantics below; ``"rendezvous"`` (or
    ``rendezvous=True``) a COMM also waits for its sends' receives -- one coalesced
    ``batch_isend_irecv`` waited whole, the old NCCL path; ``"nccl"`` first runs the plans under
    NCCL's stream model with the communicator's posting (:func:`.streams.check_streams`,
    ``"channels"``), then times them as ``"eager"`` (the two agree: each stream is one channel).

    Semantics (the runner's): a rank's COMM posts all its ops at once and blocks until each of
    its *receives* has completed; a receive completes when its counterpart send (same channel
    ``src -> dst``, same position in that channel's order) has been posted.  Sends complete in
    the background (the runner waits for them when the step ends).  ``rendezvous=True``: a COMM
    also waits for its sends' receives -- the strictest model, under which 1F1B and interleaved
    1F1B (not the zero-bubble plans) are deadlock-free too.  The counterpart must carry the same
    key ``(what, micro-batch, stage)``, or the data would be mismatched.  A forward
    takes ``t_f``; a split backward (its W in the plan) ``t_b`` and its W ``t_w``; a full backward
    ``t_b + t_w`` (``t_w = 0``, the default: a backward costs ``t_b`` as before the split).
    Communication is free.

    Returns ``{"makespan", "busy": [...], "idle": [...], "max_in_flight": [...], "bubble",
    "timeline"}`` (per rank ``[(start, end, "F3")]``, for :func:`format_timeline`):
    ``max_in_flight`` counts chunk-activations (F done, W -- or unsplit B -- not yet), ``bubble``
    is the idle share of the step, ``sum(idle) / (ranks x makespan)``.
    """
    if comm not in COMMS:
        raise ValueError(f"unknown comm model {comm!r}; choose one of {', '.join(COMMS)}")
    rendezvous = rendezvous or comm == "rendezvous"
    pp = len(plans)
    pos = channel_positions(plans)
    if comm == "nccl":
        check_streams(plans, "channels")
    ranks = _run(plans, pos, rendezvous, (t_f, t_b, t_w))
    for r, st in enumerate(ranks):
        fwd = {(m, c) for k, m, c in st.seen if k == "F"}
        if fwd != {(m, c) for k, m, c in st.seen if k == "B"} and any(k == "B" for k, _, _ in st.seen):
            raise RuntimeError(f"rank {r}: forwards {sorted(fwd)} without their backward")
    makespan = max(st.clock for st in ranks)
    busy = [st.busy for st in ranks]
    idle = [makespan - b for b in busy]
    return {"makespan": makespan, "busy": busy, "idle": idle, "max_in_flight": [st.peak for st in ranks],
            "bubble": sum(idle) / (pp * makespan) if makespan else 0.0,
            "timeline": [st.timeline for st in ranks]}


def format_timeline(result: dict, unit: float) -> str:
    """The simulated step as text, one line per rank, one 3-character cell per ``unit`` of time:
    ``F3`` forward of micro-batch 3, ``B3`` its backward (input gradient when split), ``W3`` its
    weight gradient (lower case: on a chunk other than the rank's first), `` .`` idle -- the bubble picture (a full backward of ``t_b + t_w`` fills
    two cells when ``t_w = t_b = unit``)."""
    cells = round(result["makespan"] / unit)
    lines = []
    for r, events in enumerate(result["timeline"]):
        row = [" ."] * cells
        for start, end, name in events:
            for k in range(round(start / unit), round(end / unit)):
                row[k] = name[:1] + name[1:][-1:] if len(name) > 3 else name
        lines.append(f"r{r} " + " ".join(f"{c:>2}" for c in row))
    return "\n".join(lines)
