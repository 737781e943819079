"""Multi-node launch: two torchrun agents (two "nodes" on this host) train one model together.

Each agent is ``python -m torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node 4
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<free port>``, as on two real nodes where the
endpoint is the first node's address; the 8 gloo ranks (one intra-op thread each) train the tiny
GPT of tests/test_training.py at TP 2 x PP 2 x DP 2 (ZeRO 1) on mock data. torchrun gives each
node a contiguous block of 4 global ranks, so rank 0 (which logs the layout) sits on one agent
and the last rank (which logs the loss) on the other: every step crosses the node boundary in the
pipeline, and the DP and TP groups span both agents' processes. The logged losses must equal one
process's (TP 1, PP 1, DP 1), up to the log's 7 significant digits (rtol 1e-5, as in
tests/test_training.py). About 20-40 s on two cores.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "7", "--mock-data", "--vocab-size", "100", "--train-iters", "4"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
LOSS_RE = re.compile(r"^(?: \[[^\]]*\])? iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.eE+-]+) \|", re.M)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(text: str) -> list[float]:
    return [float(m.group(2)) for m in LOSS_RE.finditer(text)]


def _agents(port: int, timeout: float = 150) -> list[tuple[int, str, str]]:
    """Start both agents at once; (exit code, stdout, stderr) of each, killed on timeout."""
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"megazero-test-{port}", "--max-restarts", "0", "pretrain_gpt.py", *TINY, *LAYOUT]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


def test_two_torchrun_agents_train_tp2_pp2_dp2_like_one_process():
    one = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    reference = _losses(one.stdout)
    assert len(reference) == 4 and all(np.isfinite(reference))

    results = _agents(_free_port())
    for node, (rc, out, err) in enumerate(results):
        assert rc == 0, f"agent {node} exited {rc}\n{out[-2000:]}\n{err[-4000:]}"
    layout_logs = [node for node, (_, out, _) in enumerate(results) if "> rank 0/8:" in out]
    loss_logs = [node for node, (_, out, _) in enumerate(results) if _losses(out)]
    assert len(layout_logs) == 1 and len(loss_logs) == 1, [r[1][-500:] for r in results]
    assert layout_logs != loss_logs, "rank 0 and the last rank ran on the same agent: not two nodes"
    losses = _losses(results[loss_logs[0]][1])
    np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg="two-node TP2 PP2 DP2 != one process")
