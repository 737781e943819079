"""Schedule tables checked without any process group."""

import pytest

from megazero.pipeline import (build_plan, chunk_layer_ranges, chunk_roles, compute_order, format_plan,
                               in_flight_bound, schedule_name, simulate, theoretical_bubble, warmup_count)

LAYOUTS = [(pp, vp, m) for pp in (2, 4) for vp in (1, 2, 3) for m in (pp, 2 * pp, 3 * pp)]


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_plan_is_complete_ordered_deadlock_free_and_meets_theory(pp, vp, m):
    plans = [build_plan(pp, vp, m, r) for r in range(pp)]
    for r, plan in enumerate(plans):
        computes = [(a.kind, a.mb, a.chunk) for a in plan if a.kind != "COMM"]
        expected = {(k, i, c) for k in "FB" for i in range(m) for c in range(vp)}
        assert sorted(computes) == sorted(expected), f"rank {r}: every F and B exactly once"
        for i, c in ((i, c) for i in range(m) for c in range(vp)):
            assert computes.index(("F", i, c)) < computes.index(("B", i, c))
        assert computes[:warmup_count(pp, vp, m, r)] == [a for a in computes[:warmup_count(pp, vp, m, r)]
                                                         if a[0] == "F"]
        for a in plan:
            if a.kind == "COMM":
                assert 1 <= len(a.ops) <= 4
    for t_f, t_b in ((1.0, 1.0), (1.0, 2.0)):
        res = simulate(plans, t_f, t_b)  # raises on deadlock or mismatched send/recv order
        for r in range(pp):
            assert res["busy"][r] == m * vp * (t_f + t_b)
            # idle slots: (PP - 1)(t_f + t_b) in chunk units, i.e. bubble (PP-1)/(VP M) of ideal
            assert res["idle"][r] == pytest.approx((pp - 1) * (t_f + t_b))
            assert res["idle"][r] / res["busy"][r] == pytest.approx(theoretical_bubble(pp, vp, m))
            assert res["max_in_flight"][r] == in_flight_bound(pp, vp, m, r)
            if vp == 1:
                assert res["max_in_flight"][r] <= min(pp - r, m) <= pp


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_forward_only_plans(pp, vp, m):
    plans = [build_plan(pp, vp, m, r, forward_only=True) for r in range(pp)]
    assert all(a.kind != "B" and all(op.what == "act" for op in a.ops) for p in plans for a in p)
    res = simulate(plans)
    assert res["idle"] == [pp - 1.0] * pp


def test_no_pipelining_is_gradient_accumulation():
    assert format_plan(build_plan(1, 1, 3, 0)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert schedule_name(1, 1) == "no-pipelining"
    assert simulate([build_plan(1, 1, 3, 0)])["idle"] == [0.0]


def test_1f1b_warmup_and_printing():
    assert [warmup_count(4, 1, 8, r) for r in range(4)] == [3, 2, 1, 0]
    assert [warmup_count(4, 1, 2, r) for r in range(4)] == [2, 2, 1, 0]
    order = compute_order(2, 1, 3, 0)
    assert order == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("B", 2, 0)]
    text = format_plan(build_plan(2, 1, 2, 1))
    assert text == "[recv act m0c0<-r0] F0.0 B0.0 [send grad m0c0->r0, recv act m1c0<-r0] F1.0 B1.0 [send grad m1c0->r0]"


def test_interleaved_order_and_warmup():
    # Megatron: warm-up 2 (PP - r - 1) + (VP - 1) PP; all forwards first when M == PP.
    assert [warmup_count(4, 2, 8, r) for r in range(4)] == [10, 8, 6, 4]
    assert [warmup_count(4, 2, 4, r) for r in range(4)] == [8, 8, 8, 8]
    fwd = [(mb, c) for k, mb, c in compute_order(2, 2, 4, 1) if k == "F"]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [(mb, c) for k, mb, c in compute_order(2, 2, 4, 1) if k == "B"]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="multiple of PP"):
        build_plan(4, 2, 6, 0)
    with pytest.raises(ValueError, match="need PP > 1"):
        build_plan(1, 2, 4, 0)


def test_chunk_layer_ranges_megatron_order():
    assert chunk_layer_ranges(8, 2, 2, 0) == [(0, 2), (4, 6)]
    assert chunk_layer_ranges(8, 2, 2, 1) == [(2, 4), (6, 8)]
    assert chunk_layer_ranges(8, 4, 1, 3) == [(6, 8)]
    assert chunk_roles(2, 2, 0) == [(True, False), (False, False)]
    assert chunk_roles(2, 2, 1) == [(False, False), (False, True)]
    assert chunk_roles(1, 1, 0) == [(True, True)]
    with pytest.raises(ValueError, match="evenly"):
        chunk_layer_ranges(6, 2, 2, 0)


def test_trace_report():
    from megazero.pipeline import bubble_report, chrome_trace, format_bubble_report
    meta = {"tp_rank": 0, "dp_rank": 0, "pp": 2, "vp": 1, "m": 2, "schedule": "1f1b"}
    traces = [{"meta": dict(meta, rank=0, pp_rank=0),
               "events": [("forward m0 c0", "forward", 0.0, 1.0, {}), ("forward m1 c0", "forward", 1.0, 2.0, {}),
                          ("backward m0 c0", "backward", 3.0, 4.0, {}), ("backward m1 c0", "backward", 5.0, 6.0, {})]},
              {"meta": dict(meta, rank=1, pp_rank=1),
               "events": [("p2p", "wait", 0.0, 1.0, {}), ("forward m0 c0", "forward", 1.0, 2.0, {}),
                          ("backward m0 c0", "backward", 2.0, 3.0, {}), ("forward m1 c0", "forward", 3.0, 4.0, {}),
                          ("backward m1 c0", "backward", 4.0, 5.0, {})]}]
    rep = bubble_report(traces)
    assert rep["bubble_per_rank"] == {0: 0.5, 1: 0.5} and rep["bubble_theory"] == 0.5 and rep["step_time_s"] == 6.0
    assert "theory (PP-1)/(VP*M) = 0.500" in format_bubble_report(rep)
    ev = chrome_trace(traces)["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == 9 and {e["pid"] for e in ev} == {0, 1}
