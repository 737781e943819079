"""The plans under NCCL's point-to-point semantics: a model of communication streams that decides
whether a way of posting the exchanges can deadlock, for every rank's plan together.

NCCL facts the model encodes (NCCL user guide, "Point-to-point communication", ``ncclSend``: the
op *blocks the GPU stream* it runs on until the peer's matching op runs; ops that must progress
together have to be fused in one ``ncclGroupStart/End``): every op -- or every fused group --
holds the head of a FIFO stream until it completes, and a send and its receive complete only
when both head their streams.  What is a stream depends on how torch issues the op (torch 2.13):
``batch_isend_irecv`` on NCCL coalesces the batch into one group on the process group's
communicator (distributed_c10d.py ``batch_isend_irecv``, the ``supports_coalescing`` branch),
one stream per rank and group; a single ``isend``/``irecv`` runs on a two-rank communicator of
that group and pair when the group was created lazily (pytorch/pytorch#132852, #152220) but on
the group's own communicator -- one stream per rank and group again -- when the default group is
bound to a device, as megazero's launcher binds it (``device_id``; pytorch/pytorch#154132:
"all p2p communication would use the same collective communicator ... serialized").

Postings (``units`` below), for a plan's COMM (sends of the step before, receives of the next):

* ``"coalesced"`` -- the COMM as one ``batch_isend_irecv``, waited whole: the old NCCL path, and
  Megatron's (p2p_communication.py ``_batched_p2p_ops`` + ``wait_on_reqs``).  Safe for 1F1B,
  interleaved 1F1B and ZB-H1; deadlocks ``interleaved-zb``, ``zbv`` and ``dualpipev``.
* ``"pairs"`` -- single ops on one group per pair: both directions share a stream; deadlocks
  even 1F1B (both neighbours send first).  ``"send-recv"`` / ``"up-down"`` -- two streams per
  rank, one for its sends and one for its receives, or one per direction along the pipeline:
  still deadlock ``interleaved-zb`` (and, up-down, ``zbv``) from PP 4; only one per channel is safe.
* ``"channels"`` -- what :class:`~.p2p.P2PCommunicator` posts: single ops, the channel ``src ->
  dst`` on communicator :func:`channel_class`, of which each rank uses at most one per class, so
  that every stream -- under either rule above -- carries one channel in one direction, in
  order; receives waited before the next compute, sends at the end of the step; each COMM also
  posts the next COMM's receives (waited there), so their transfer overlaps the compute in
  between -- a channel's receives stay in its order on its own stream.  A blocked send (or an
  early receive) then holds up only later ops of its channel, which come later anyway: the
  plans that are deadlock-free with sends in the background (:func:`~.simulate.simulate`) are so here.
* ``strict`` (with ``"channels"``): the rank itself waits for a channel's previous send before it
  posts the next one (what a CPU-blocking wait on a send would do). Deadlocks ``interleaved-zb``
  (``zbv`` and ``dualpipev`` too, but for the receives posted ahead): the communicator never
  waits for a send before the step ends (NCCL's CPU never does; gloo's would).
"""

from __future__ import annotations

POSTINGS = ("channels", "coalesced", "pairs", "send-recv", "up-down")


def channel_classes(pp: int) -> int:
    """How many communicators the channels of a ``pp``-rank pipeline need (:func:`channel_class`)."""
    return 0 if pp < 2 else 2 if pp == 2 else 4 if pp % 2 == 0 else 6


def channel_class(pp: int, src: int, dst: int) -> int:
    """The communicator (``0 <= class < channel_classes(pp)``) that carries the messages of
    pipeline rank ``src`` to its neighbour ``dst``: ``2 colour + direction``, where the pair
    ``{i, i + 1 mod PP}`` has colour ``i % 2`` (colour 2 for the wrap pair when PP is odd), so
    the two pairs of a rank differ, and direction 0 is ``i -> i + 1``.  Each rank so uses at most
    one channel of each class: one NCCL stream per channel."""
    if pp == 2:
        return src
    if (src + 1) % pp == dst:
        pair, direction = src, 0
    elif (dst + 1) % pp == src:
        pair, direction = dst, 1
    else:
        raise ValueError(f"pipeline ranks {src} -> {dst} are not neighbours (PP {pp})")
    colour = 2 if pp % 2 and pair == pp - 1 else pair % 2
    return 2 * colour + direction


def units(rank: int, ops, posting: str, pp: int) -> list[tuple[object, list[int], bool]]:
    """``[(stream, op indices, waited before the next compute)]`` for one COMM's ``ops`` of
    pipeline ``rank`` of ``pp``, in posting order (a hand-over inside the rank, ``peer == rank``, is no unit)."""
    idx = [j for j, op in enumerate(ops) if op.peer != rank]
    if posting == "coalesced":
        return [("group", idx, True)] if idx else []
    if posting not in POSTINGS:
        raise ValueError(f"unknown posting {posting!r}; choose one of {', '.join(POSTINGS)}")
    order = [j for j in idx if ops[j].op == "send"] + [j for j in idx if ops[j].op == "recv"]
    out = []
    for j in order:
        op = ops[j]
        src, dst = (rank, op.peer) if op.op == "send" else (op.peer, rank)
        if posting == "channels":
            stream = ("class", channel_class(pp, src, dst))
        elif posting == "pairs":
            stream = ("pair", min(src, dst), max(src, dst))
        else:
            stream = (posting, op.op if posting == "send-recv" else src < dst)
        out.append((stream, [j], op.op == "recv"))
    return out


def channel_positions(plans) -> dict[tuple, int]:
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


class _Unit:
    def __init__(self, stream, keys):
        self.stream, self.keys, self.fired = stream, keys, set()

    @property
    def done(self) -> bool:
        return len(self.fired) == len(self.keys)


def next_comms(plan) -> list:
    """Per action of ``plan``: for a COMM, the index of the plan's next COMM (None: the last);
    None for a compute. The receives of that next COMM are the ones a COMM posts ahead."""
    out, later = [None] * len(plan), None
    for i in range(len(plan) - 1, -1, -1):
        if plan[i].kind == "COMM":
            out[i], later = later, i
    return out


def _comm_state(r, plan, pc, posting, pp, early, nxt) -> list:
    """``[units, 0, units to wait for]`` of rank ``r``'s COMM ``plan[pc]``: its units ``(stream,
    op indices, waited, action index)`` still to post -- with ``"channels"``, its receives posted
    ahead by the COMM before are only waited, and the next COMM's receives are posted ahead
    (``early`` keeps those units by ``(action index, op index)`` until their COMM; ``nxt``: the
    next COMM's index, :func:`next_comms`)."""
    own, waited = [], []
    for stream, js, wait in units(r, plan[pc].ops, posting, pp):
        if (pc, js[0]) in early:
            waited.append(early.pop((pc, js[0])))
        else:
            own.append((stream, js, wait, pc))
    if posting == "channels" and nxt is not None:
        own += [(stream, js, False, nxt) for stream, js, _ in units(r, plan[nxt].ops, posting, pp)
                if plan[nxt].ops[js[0]].op == "recv"]
    return [own, 0, waited]


def _post(r, plan, pos, strict, queues, where, state, early) -> bool:
    """Post the units of ``state`` (:func:`_comm_state`, rank ``r``) onto ``r``'s stream queues, in
    order; ``state`` = ``[units, next index, units to wait for]`` carries a partly posted COMM
    (``strict``: a send waits for its channel's previous send first). True once all are posted."""
    todo, i, waited = state
    while i < len(todo):
        stream, js, wait, pc = todo[i]
        ops = plan[pc].ops
        if strict and ops[js[0]].op == "send" and queues.get((r, stream)):
            break
        keys = []
        for j in js:
            op = ops[j]
            ch = (r, op.peer) if op.op == "send" else (op.peer, r)
            keys.append((ch, op.op, pos[(r, pc, j)]))
        u = _Unit((r, stream), keys)
        for k in keys:
            where[k] = u
        queues.setdefault(u.stream, []).append(u)
        if wait:
            waited.append(u)
        elif ops[js[0]].op == "recv":  # posted ahead: waited at its own COMM
            early[(pc, js[0])] = u
        i += 1
    state[1] = i
    return i == len(todo)


def _fire(queues, where) -> bool:
    """Complete every op whose unit and whose counterpart's unit head their streams; pop finished
    units. Returns whether anything moved."""
    moved = False
    for q in queues.values():
        if not q:
            continue
        u = q[0]
        for k in u.keys:
            if k in u.fired:
                continue
            other = (k[0], "recv" if k[1] == "send" else "send", k[2])
            v = where.get(other)
            if v is not None and queues[v.stream] and queues[v.stream][0] is v:
                u.fired.add(k)
                v.fired.add(other)
                moved = True
    for q in queues.values():
        while q and q[0].done:
            q.pop(0)
            moved = True
    return moved


def check_streams(plans, posting: str = "channels", strict: bool = False) -> None:
    """Run every rank's plan under the stream model with ``posting``; raise ``RuntimeError``
    naming the blocked ranks on a deadlock. Computes take no time here (only order matters);
    raises too when a channel's sends and receives do not match in order."""
    pos = channel_positions(plans)
    pcs, states = [0] * len(plans), [None] * len(plans)
    early: list[dict] = [{} for _ in plans]  # per rank: receive units posted ahead of their COMM
    nexts = [next_comms(plan) for plan in plans]
    queues: dict = {}
    where: dict = {}
    while True:
        moved = False
        for r, plan in enumerate(plans):
            while pcs[r] < len(plan):
                a = plan[pcs[r]]
                if a.kind == "COMM":
                    if states[r] is None:
                        states[r] = _comm_state(r, plan, pcs[r], posting, len(plans), early[r], nexts[r][pcs[r]])
                    before = states[r][1]
                    posted = _post(r, plan, pos, strict, queues, where, states[r], early[r])
                    moved = moved or states[r][1] > before
                    if not posted or not all(u.done for u in states[r][2]):
                        break
                    states[r] = None
                pcs[r] += 1
                moved = True
        moved = _fire(queues, where) or moved
        if all(pc == len(p) for pc, p in zip(pcs, plans)) and not any(queues.values()):
            return
        if not moved:
            stuck = {r: str(p[pcs[r]]) for r, p in enumerate(plans) if pcs[r] < len(p)}
            unsent = sorted(u.stream for q in queues.values() for u in q[:1])
            raise RuntimeError(f"deadlock under {posting}{' (strict)' if strict else ''} posting: "
                               f"ranks blocked at {stuck}, streams stuck {unsent}")
