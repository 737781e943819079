"""bench/pipeline_wall.py --pace: the dedicated-device emulation holds each F/B/W to K x its
calibrated time (an overrun is counted, not held) and a paced step is never shorter than a
rank's own slots."""

import time
from argparse import Namespace
from types import SimpleNamespace

from .bench_loader import load_bench


def _load():
    return load_bench("pipeline_wall")


def test_paced_trace_holds_an_action_to_its_slot_and_counts_overruns():
    mod = _load()
    trace = mod.PacedTrace({("F", 0): 0.01, ("Bs", 0): 0.004}, split={(0, 0)}, k=3)
    f = SimpleNamespace(kind="F", mb=1, chunk=0, ops=())  # micro-batch 1 not split: the undivided F's slot
    t0 = time.perf_counter()
    trace.record(f, t0, t0 + 0.001)
    assert time.perf_counter() - t0 >= 0.03 and trace.overruns == 0
    b = SimpleNamespace(kind="B", mb=0, chunk=0, ops=())  # split: the input-gradient B's slot (0.012 s)
    t1 = time.perf_counter()
    trace.record(b, t1 - 0.02, t1)  # took longer than its slot: counted
    assert trace.overruns == 1 and trace.actions == 2
    assert [e[1] for e in trace.events] == ["forward", "backward"]


def test_paced_step_is_at_least_a_ranks_own_slots():
    """PP 2, M 4, a tiny GPT, K = 6: every rank's paced 1F1B step lasts at least K x the sum of its
    calibrated F and undivided B over the micro-batches; zb-h1 runs paced too."""
    from megazero.testing import run_distributed
    mod = _load()
    args = Namespace(micro_batches=4, micro_batch=1, hidden=64, seq=16, rounds=1, steps=1, schedules=["zb-h1"],
                     pace=[6.0], pace_rounds=1)
    results = run_distributed(mod._bench, 2, args, timeout_s=240)
    for out in results:
        cal = out["cal"]["1f1b"]
        floor = 6.0 * 4 * (cal[("F", 0)] + cal[("B", 0)])
        assert min(out[6.0][1]["1f1b"]) >= floor
        assert set(out[("overruns", 6.0)]) == {"1f1b", "zb-h1"} and out[6.0][0]["zb-h1"][0] > 0
