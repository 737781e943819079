"""bench/gpu_check.py cannot rot: its CPU dry run (every phase, tiny sizes) in the suite, and the
report's verdict rules on made-up reports. The real run needs a GPU (docs/benchmarks.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_report  # noqa: E402


def test_dry_run_writes_a_passing_report(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path), "--jobs", "2",
                          "--cpu-threads", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{md}"
    assert report["dry_run"] and report["verdict"] == {"pass": True, "failed": [], "targets": {}}
    assert report["environment"]["torch"] and report["environment"]["gpu"] is None
    runs = report["correctness"]["runs"]
    assert [(r["dtype"], r["zero"], r["variant"]) for r in runs] == [
        ("fp32", 0, "dense"), ("fp32", 3, "dense"), ("bf16", 0, "dense"), ("bf16", 3, "dense"), ("fp32", 1, "moe")]
    for r in runs:
        assert len(r["cpu_losses"]) == 6 and r["cpu_losses"][-1] < r["cpu_losses"][0]  # the counting corpus is learnt
    gen = report["generation"]
    assert gen["pass"] and len(gen["cpu_tokens"]) == 3 and all(len(t) == 12 for t in gen["cpu_tokens"])
    speed = report["speed"]
    assert [r["recompute"] for r in speed["megazero"]] == [None, "selective"]
    for r in speed["megazero"]:
        assert r["tokens_per_s"] > 0 and r["vs_peer"] > 0 and r["params"] == speed["peer"]["params"]
        assert 0 < r["planner"]["model_state_bytes"] < r["planner"]["total_bytes"]
    for heading in ("## Environment", "## Correctness", "## Speed", "## Memory per phase"):
        assert heading in md


def _report(**over):
    run = {"dtype": "fp32", "zero": 0, "iters": 2, "device_losses": [2.0, 1.0], "cpu_losses": [2.0, 1.0],
           "max_rel_diff": 0.0, "tolerance": 1e-4, "pass": True}
    mz = {"tokens_per_s": 100.0, "mfu": 0.5, "vs_peer": 1.2}
    r = {"dry_run": False, "correctness": {"runs": [run]}, "generation": {"pass": True},
         "speed": {"megazero": [mz, dict(mz, tokens_per_s=90.0, mfu=0.45, vs_peer=1.08)]}}
    r.update(over)
    return r


def test_verdict_rules():
    v = gpu_report.verdict(_report())
    assert v["pass"] and v["targets"] == {"mfu": 0.5, "mfu_met": True, "vs_peer": 1.2, "vs_peer_met": True}
    bad = _report(generation={"pass": False}, speed={"error": "RuntimeError: boom"})
    bad["correctness"]["runs"].append(dict(bad["correctness"]["runs"][0], dtype="bf16", max_rel_diff=0.1,
                                           **{"pass": False}))
    v = gpu_report.verdict(bad)
    assert not v["pass"] and v["targets"] == {}
    assert v["failed"] == ["speed", "correctness bf16 ZeRO 0: max rel diff 1.00e-01",
                           "generation: device tokens differ from the CPU's"]
    slow = _report(speed={"megazero": [{"tokens_per_s": 1.0, "mfu": 0.3, "vs_peer": 0.8}]})
    v = gpu_report.verdict(slow)
    assert v["pass"] and not v["targets"]["mfu_met"] and not v["targets"]["vs_peer_met"]  # targets do not fail it
    assert "NOT met" in gpu_report.markdown(dict(slow, speed={}), v)
