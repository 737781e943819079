"""The plans under NCCL's stream semantics (megazero.pipeline.streams): the communicator's posting
-- single ops, one communicator per channel class -- is deadlock-free for every schedule, while
the old posting (each exchange one coalesced batch waited whole), single ops on one stream per
pair, two streams per rank, or a CPU that waits for sends mid-step deadlock zero-bubble plans."""

from __future__ import annotations

import pytest

from megazero.pipeline import build_plan, check_plans, simulate
from megazero.pipeline.streams import channel_class, channel_classes, check_streams, units

VP = {"1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")  # those the old posting deadlocks (not zb-h1)


def _plans(name, pp, m, vp=None, forward_only=False):
    vp = VP[name] if vp is None else vp
    return [build_plan(pp, vp, m, r, forward_only=forward_only, schedule=name) for r in range(pp)]


def _grid():
    for pp in (2, 3, 4, 5, 8):
        for m in sorted({1, pp, 2 * pp, 3 * pp, pp + 1} if pp < 5 else {pp, 2 * pp}):
            for name, vp in list(VP.items()) + [("interleaved-zb", 3), ("interleaved-1f1b", 3)]:
                if name == "interleaved-1f1b" and m % pp or name == "dualpipev" and m < 2 * pp:
                    continue
                yield name, pp, vp, m


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8, 9])
def test_each_rank_uses_one_channel_per_class(pp):
    seen = {}
    for r in range(pp):
        chans = {(r, (r + d) % pp) for d in (-1, 1)} | {((r + d) % pp, r) for d in (-1, 1)}
        classes = [channel_class(pp, *c) for c in chans]
        assert len(set(classes)) == len(chans) and set(classes) <= set(range(channel_classes(pp))), (r, chans)
        for c, k in zip(chans, classes):
            seen.setdefault(k, set()).add(c)
    assert sorted(seen) == list(range(channel_classes(pp)))
    with pytest.raises(ValueError, match="not neighbours"):
        channel_class(pp, 0, pp // 2) if pp > 3 else channel_class(8, 0, 4)


def test_communicator_posting_is_deadlock_free_for_every_schedule():
    """PP 2/3/4/5/8, M from 1 to 3 PP, training and forward-only: the posting the communicator runs
    (on NCCL and gloo alike) never deadlocks, and its timing equals the eager model's."""
    n = 0
    for name, pp, vp, m in _grid():
        for fo in (False, True):
            try:
                plans = _plans(name, pp, m, vp, fo)
            except ValueError:  # a shape the schedule refuses (e.g. interleaved-zb rounds)
                continue
            check_streams(plans, "channels")
            assert simulate(plans, 1, 1, 1, comm="nccl") == simulate(plans, 1, 1, 1)
            n += 1
    assert n > 100


def test_old_coalesced_posting_deadlocks_zero_bubble_plans():
    """Each exchange as one batch_isend_irecv waited whole (the old NCCL path, Megatron's 1F1B
    pairing): fine for 1F1B, interleaved 1F1B and ZB-H1, a deadlock for the other zero-bubble
    plans -- and the stream model agrees with the simulator's rendezvous model case by case."""
    for name in ZERO_BUBBLE:
        with pytest.raises(RuntimeError, match="deadlock under coalesced"):
            check_streams(_plans(name, 4, 8), "coalesced")
    for name, pp, vp, m in _grid():
        try:
            plans = _plans(name, pp, m, vp)
        except ValueError:
            continue
        try:
            check_streams(plans, "coalesced")
            model = True
        except RuntimeError:
            model = False
        try:
            simulate(plans, comm="rendezvous")
            rendezvous = True
        except RuntimeError:
            rendezvous = False
        assert model == rendezvous, (name, pp, vp, m)
        assert model or name in ZERO_BUBBLE, (name, pp, vp, m)


def test_shared_streams_deadlock():
    """Single ops with both directions of a pair on one stream deadlock even 1F1B; a CPU that
    waits for a channel's previous send before posting the next deadlocks interleaved ZB (ZBV and
    DualPipeV only escape it because each COMM posts the next one's receives ahead, which the
    model so shows it runs); two streams per rank (sends / receives, or up / down) deadlock
    interleaved ZB (and ZBV)."""
    with pytest.raises(RuntimeError, match="deadlock under pairs"):
        check_streams(_plans("1f1b", 2, 4), "pairs")
    for pp, m in ((4, 8), (4, 16), (8, 16)):
        with pytest.raises(RuntimeError, match=r"deadlock under channels \(strict\)"):
            check_streams(_plans("interleaved-zb", pp, m), "channels", strict=True)
    for name in ("1f1b", "zbv", "dualpipev"):
        check_streams(_plans(name, 4, 8), "channels", strict=True)
    for posting, names in (("send-recv", ["interleaved-zb"]), ("up-down", ["interleaved-zb", "zbv"])):
        for name in names:
            with pytest.raises(RuntimeError, match=f"deadlock under {posting}"):
                check_streams(_plans(name, 4, 8), posting)
        check_streams(_plans("1f1b", 4, 8), posting)


def test_units_and_errors():
    plan = build_plan(4, 2, 8, 0, schedule="zbv")
    comm = next(a for a in plan if a.kind == "COMM" and len(a.ops) > 1)
    coalesced = units(0, comm.ops, "coalesced", 4)
    assert len(coalesced) == 1 and coalesced[0][2] and len(coalesced[0][1]) == len(comm.ops)
    single = units(0, comm.ops, "channels", 4)
    assert [len(js) for _, js, _ in single] == [1] * len(comm.ops)
    assert [w for _, js, w in single] == [comm.ops[js[0]].op == "recv" for _, js, _ in single]
    with pytest.raises(ValueError, match="unknown posting"):
        units(0, comm.ops, "ring", 4)
    with pytest.raises(ValueError, match="unknown comm model"):
        simulate(_plans("1f1b", 2, 2), comm="ring")


def test_check_plans_runs_the_stream_model():
    for name in VP:
        check_plans(4, VP[name], 8, name)
