"""bench/pipeline.py --bubble-table: the simulated table meets the published figures and
torch's own plans give megazero's numbers (no processes)."""

import os
import subprocess
import sys

import pytest

from .bench_loader import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    return load_bench("pipeline_bubbles")


def test_table_rows_meet_the_published_figures():
    rows = {(r["schedule"], r["pp"], r["m"]): r for r in _load().table(pps=(4,), ms=(8, 16))}
    for r in rows.values():
        if r["published"] is not None:
            assert r["bubble"] == pytest.approx(r["published"]), r
        if r["torch"] != "n/a":
            assert r["torch"] == pytest.approx(r["bubble"]), r  # torch's plan, megazero's simulator
    assert rows[("zb-h1", 4, 8)]["idle_vs_1f1b"] == pytest.approx(1 / 3)
    assert rows[("zbv", 4, 8)]["idle_vs_1f1b"] == pytest.approx(1 / 6)
    for name in ("1f1b", "zb-h1", "zbv", "interleaved-zb"):  # 1F1B's memory: PP stages' activations
        assert rows[(name, 4, 16)]["peak"] == 4
    md = _load().markdown(list(rows.values()))
    assert md[0].startswith("| schedule | PP | M | bubble |") and len(md) == 2 + len(rows)


def test_bench_script_prints_the_table():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "bench/pipeline.py", "--bubble-table"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| zbv | 4 | 8 | 0.059 | 0.059 | 0.059 | 0.167 | 4 |" in r.stdout


def test_side_by_side_with_torchs_schedules_gives_equal_losses_and_gradients():
    """bench/pipeline.py --zero-bubble at PP 2: megazero's runner and torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble / ScheduleDualPipeV (and Schedule1F1B) on
    the same split of the same model: per-micro-batch losses and every gradient equal."""
    from megazero.testing import run_distributed
    mod = load_bench("pipeline_zero_bubble")
    res = run_distributed(mod.bench, 2, 4, 2, 8, 32, 1, 0, timeout_s=240)[0]
    assert set(res) == {"1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev"}
    for name, r in res.items():
        assert not r["loss_count_differs"] and r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, (name, r)
    assert len(mod.report(res, 2, 4)) == 1 + len(res)
