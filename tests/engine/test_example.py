"""examples/any_model/roberta_mlm.py runs (one process, a few steps) and its loss falls."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def test_roberta_mlm_example_runs_and_learns():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "any_model" / "roberta_mlm.py"), "--steps", "10",
                          "--seq", "32"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2 and losses[-1] < 6.5, out.stdout  # ln(vocabulary) = 6.91 at the start
