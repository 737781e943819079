"""The GPU example scripts' flags stay valid (DRY_RUN=1: argument validation + memory planner)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,world", [("pretrain_gpt_1gpu.sh", 1), ("pretrain_gpt_8gpu.sh", 8)])
def test_gpu_example_flags_validate_and_fit(tmp_path, script, world):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable, MOCK="1")
    out = subprocess.run(["bash", str(ROOT / "examples" / script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"flags OK: world {world}" in out.stdout
    assert "yes" in out.stdout.split("fits 80 GiB", 1)[1]  # the planner says the chosen layout fits
