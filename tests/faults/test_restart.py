"""Restart without a human (issue 46, item 4): under ``torchrun --max-restarts 1`` a rank SIGKILLed
mid-interval comes back, loads the latest complete checkpoint of ``--load`` = ``--save`` by itself,
skips the samples already seen and ends with the uninterrupted run's losses, exactly (fp32); the
restarted attempt says what it resumed and what it redoes. The rendezvous keys of a killed attempt
are never read by the next one."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from megazero.testing import free_port
from tests.faults.common import MOCK, TINY

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [*TINY, *MOCK, "--train-iters", "8", "--save-interval", "3", "--distributed-timeout-minutes", "1"]
LINE = re.compile(r"\] iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \|.*\| grad norm: (\S+) \|")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def torchrun(script_args: list[str], cwd: Path, max_restarts: int, timeout_s: float = 200) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2`` (static rendezvous on a free port: the agent hosts the store
    and keeps it across restarts); its exit status and output. A hang is killed, torchrun and its
    ranks, and fails the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
           str(max_restarts), "--master-port", str(free_port()), "--monitor-interval", "0.2", *script_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun hung for {timeout_s} s:\n{out[-4000:]}")
    return proc.returncode, out


def logged(out: str) -> dict[int, tuple[str, str]]:
    """Iteration -> (lm loss, grad norm) as printed; a redone iteration keeps its last line."""
    return {int(m[1]): (m[2], m[3]) for m in LINE.finditer(out)}


def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_with_the_uninterrupted_losses(tmp_path):
    ck = str(tmp_path / "ck")
    code, out = torchrun([str(ROOT / "tests/faults/kill_rank.py"), "1", "5", "2", *FLAGS, "--save", ck,
                          "--load", ck], tmp_path, max_restarts=1)
    assert code == 0, out[-4000:]
    assert "Connection refused" not in out, out[-4000:]
    ref_code, ref = torchrun([str(ROOT / "pretrain_gpt.py"), *FLAGS, "--save", str(tmp_path / "ref")], tmp_path,
                             max_restarts=0)
    assert ref_code == 0, ref[-4000:]
    assert logged(out) == logged(ref) and sorted(logged(ref)) == list(range(1, 9))
    assert "loaded checkpoint from" in out and "at iteration 3" in out
