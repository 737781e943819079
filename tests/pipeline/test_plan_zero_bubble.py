"""Zero-bubble plans: PyTorch's own orders, the simulator's checks, bubble and memory figures."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from megazero.pipeline import (Action, build_plan, chunk_layer_ranges, chunk_roles, compute_order, format_timeline,
                               in_flight_bound, rank_of_stage, simulate, split_backwards, stage_of_chunk,
                               theoretical_bubble)

TORCH = {"zb-h1": "ScheduleInterleavedZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
VP = {"zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


def torch_order(name, pp, vp, m):
    """``pipeline_order`` of torch's schedule class (built from stand-in stages, no process
    group) as megazero's (kind, micro-batch, local chunk); I -> B, overlapped pairs flattened."""
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * vp, submod=torch.nn.Linear(1, 1))
              for _ in range(vp)]
    sched = getattr(torch_schedules, TORCH[name])(stages, m, loss_fn=lambda out, target: out)
    v = name in ("zbv", "dualpipev")
    out = {}
    for r, acts in sched.pipeline_order.items():
        seq = []
        for a in (a for a in acts if a is not None):
            for x in a.sub_actions or [a]:
                c = (0 if x.stage_index == r else 1) if v else x.stage_index // pp
                seq.append(({"I": "B"}.get(x.computation_type.value, x.computation_type.value), x.microbatch_index, c))
        out[r] = seq
    return out


CASES = [(name, pp, m) for name in TORCH for pp in (2, 4) for m in (2 * pp, 3 * pp, 16)]


@pytest.mark.parametrize("name,pp,m", CASES)
def test_orders_are_pytorchs(name, pp, m):
    vp = VP[name]
    assert {r: compute_order(pp, vp, m, r, name) for r in range(pp)} == torch_order(name, pp, vp, m)


@pytest.mark.parametrize("name,pp,m", CASES)
def test_plans_complete_deadlock_free_and_bounded(name, pp, m):
    vp = VP[name]
    plans = [build_plan(pp, vp, m, r, schedule=name) for r in range(pp)]
    for r, plan in enumerate(plans):
        computes = [(a.kind, a.mb, a.chunk) for a in plan if a.kind != "COMM"]
        assert sorted(k for k in computes if k[0] != "W") == sorted((k, i, c) for k in "FB" for i in range(m)
                                                                     for c in range(vp))
        assert len(set(computes)) == len(computes)
        if name != "dualpipev":  # dualpipev keeps most backwards whole
            assert split_backwards(plan) == {(i, c) for i in range(m) for c in range(vp)}
    res = simulate(plans, 1.0, 1.0, 1.0)
    assert res["busy"] == [3.0 * m * vp] * pp
    # memory: chunk-activations live from F to W; 1F1B's rank 0 holds PP whole-stage activations
    bound = {"zb-h1": pp, "interleaved-zb": 2 * pp, "zbv": 2 * pp, "dualpipev": 2 * pp + 1}[name]
    assert max(res["max_in_flight"]) == bound
    fwd = [build_plan(pp, vp, m, r, forward_only=True, schedule=name) for r in range(pp)]
    simulate(fwd)


def idle(name, pp, m):
    """Rank 0's idle time, a whole stage's F = B = W = 1 (a chunk of VP takes 1 / VP of it)."""
    vp = VP.get(name, 1)
    t = 1.0 / vp
    return simulate([build_plan(pp, vp, m, r, schedule=name) for r in range(pp)], t, t, t)["idle"][0]


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubbles_against_the_paper(pp, m):
    base = idle("1f1b", pp, m)
    assert base == 3 * (pp - 1)  # 1F1B: (PP - 1)(F + B + W)
    assert idle("zb-h1", pp, m) == pytest.approx(base / 3)  # ZB-H1: (PP - 1)(F + B - 2W)
    assert idle("zbv", pp, m) <= base / 6 + 1e-9


def test_zbv_is_a_sixth_of_1f1b_at_pp4_m8():
    assert idle("zbv", 4, 8) == pytest.approx(idle("1f1b", 4, 8) / 6)


def test_v_placement_and_local_turn():
    assert [stage_of_chunk(4, 2, r, c, "v") for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(rank_of_stage(4, stage_of_chunk(4, 2, r, c, "v"), "v") == (r, c) for r in range(4) for c in (0, 1))
    assert chunk_layer_ranges(16, 4, 2, 0, "v") == [(0, 2), (14, 16)]
    assert chunk_layer_ranges(16, 4, 2, 3, "v") == [(6, 8), (8, 10)]
    assert chunk_roles(4, 2, 0, "v") == [(True, False), (False, True)]
    assert chunk_roles(4, 2, 2, "v") == [(False, False), (False, False)]
    with pytest.raises(ValueError, match="fold"):
        chunk_layer_ranges(12, 4, 2, 0, "v")
    plan = build_plan(4, 2, 8, 3, schedule="zbv")
    local = [op for a in plan for op in a.ops if op.peer == 3]
    assert {(op.op, op.what) for op in local} == {("send", "act"), ("recv", "act"), ("send", "grad"), ("recv", "grad")}
    assert len(local) == 4 * 8
    # rank 0's second chunk (the last stage) sends gradients to rank 1, its first receives none
    plan0 = build_plan(4, 2, 8, 0, schedule="zbv")
    assert {(op.op, op.what, op.chunk, op.peer) for a in plan0 for op in a.ops} == {
        ("send", "act", 0, 1), ("recv", "act", 1, 1), ("send", "grad", 1, 1), ("recv", "grad", 0, 1)}


def test_zero_bubble_plans_need_sends_in_the_background():
    """A COMM that also waited for its sends' receives would deadlock these plans (the runner
    waits for receives only), while 1F1B and interleaved 1F1B survive even that."""
    for name in ("interleaved-zb", "zbv"):
        with pytest.raises(RuntimeError, match="deadlock"):
            simulate([build_plan(4, 2, 8, r, schedule=name) for r in range(4)], rendezvous=True)
    for vp in (1, 2):
        simulate([build_plan(4, vp, 8, r) for r in range(4)], rendezvous=True)


def test_simulator_rejects_bad_plans():
    with pytest.raises(RuntimeError, match="before its B"):
        simulate([[Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0)]])
    with pytest.raises(RuntimeError, match="runs twice"):
        simulate([[Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0), Action("W", 0, 0)]])
    with pytest.raises(RuntimeError, match="without their backward"):
        simulate([[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0)]])


def test_schedule_shape_errors():
    with pytest.raises(ValueError, match="needs exactly 2 chunks per rank"):
        build_plan(4, 1, 8, 0, schedule="zbv")
    with pytest.raises(ValueError, match="needs no virtual stages"):
        build_plan(4, 2, 8, 0, schedule="zb-h1")
    with pytest.raises(ValueError, match="needs virtual stages"):
        build_plan(4, 1, 8, 0, schedule="interleaved-zb")
    with pytest.raises(ValueError, match="at least 2 x PP = 8 micro-batches"):
        build_plan(4, 2, 6, 0, schedule="dualpipev")
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_plan(4, 2, 8, 0, schedule="dualpipe")


def test_bubble_picture_shows_the_ws_in_1f1b_cool_down():
    res = simulate([build_plan(4, 1, 8, r, schedule="zb-h1") for r in range(4)], 1.0, 1.0, 1.0)
    lines = format_timeline(res, 1.0).splitlines()
    assert lines[0] == "r0 F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert lines[3].endswith("B7 W4 W5 W6 W7")  # the last rank's held W's fill the drain
    res = simulate([build_plan(4, 2, 8, r, schedule="zbv") for r in range(4)], 0.5, 0.5, 0.5)
    assert format_timeline(res, 0.5).splitlines()[3].startswith("r3  .  .  . F0 f0 F1 f1")  # the V's turn


@pytest.mark.parametrize("name,vp", [("zb-h1", 1), ("interleaved-zb", 2), ("interleaved-zb", 3), ("zbv", 2),
                                     ("dualpipev", 2)])
def test_closed_forms_are_the_simulators(name, vp):
    """in_flight_bound (the planner's memory) and theoretical_bubble (its time) = the simulator."""
    for pp in (2, 3, 4, 8):
        for m in sorted({1, 2, 3, pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp, 4 * pp}):
            if (name == "dualpipev" and m < 2 * pp) or (name == "interleaved-zb" and m % max(1, m // pp)):
                continue
            res = simulate([build_plan(pp, vp, m, r, schedule=name) for r in range(pp)], 1.0, 1.0, 1.0)
            assert res["max_in_flight"] == [in_flight_bound(pp, vp, m, r, name) for r in range(pp)], (pp, m)
            assert theoretical_bubble(pp, vp, m, name) == pytest.approx(sum(res["idle"]) / sum(res["busy"])), (pp, m)


def test_trace_records_ws_and_reports_the_simulated_theory():
    from megazero.pipeline import ScheduleTrace, bubble_report, chrome_trace, format_bubble_report
    trace = ScheduleTrace()
    trace.meta = {"rank": 0, "pp_rank": 0, "tp_rank": 0, "dp_rank": 0, "pp": 4, "vp": 1, "m": 8, "schedule": "zb-h1"}
    for i, a in enumerate([Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)]):
        trace.record(a, float(i), i + 1.0)
    assert [e[:2] for e in trace.events][2] == ("weight-grad m0 c0", "weight-grad") and trace.busy() == 3.0
    assert any(e.get("cat") == "weight-grad" for e in chrome_trace([{"meta": trace.meta, "events": trace.events}])[
        "traceEvents"])
    rep = bubble_report([{"meta": trace.meta, "events": trace.events}])
    assert rep["bubble_theory"] == pytest.approx(3 / 24)  # ZB-H1: (PP - 1) / (3 M)
    assert "vs theory simulated with F=B=W = 0.125" in format_bubble_report(rep)


def test_check_plans_before_a_run():
    from megazero.pipeline import check_plans
    for name, vp in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)):
        assert check_plans(4, vp, 8, name)["busy"] == [24.0 * vp] * 4
    with pytest.raises(ValueError, match=r"pipeline schedule dualpipev \(PP 4, VP 2, M 6\): dualpipev needs"):
        check_plans(4, 2, 6, "dualpipev")
