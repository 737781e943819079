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
from datetime import timedelta
from pathlib import Path

import pytest

from megazero.parallel.launch import LaunchEnv, attempt_prefix, rendezvous_store
from megazero.testing import free_port
from megazero.training.restart import PROGRESS_NAME, read_progress, resume_line, write_progress
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


def torchrun(script_args: list[str], cwd: Path, max_restarts: int, timeout_s: float = 200,
             kill: str | None = None) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2`` (static rendezvous on a free port: the agent hosts the store
    and keeps it across restarts); its exit status and output. A hang is killed, torchrun and its
    ranks, and fails the test. ``kill``: tests/faults/kill_rank.py's ``RANK:ITERATIONS:MICRO_BATCHES``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if kill:
        env["MEGAZERO_TEST_KILL"] = kill
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
    code, out = torchrun([str(ROOT / "tests/faults/kill_rank.py"), *FLAGS, "--save", ck, "--load", ck], tmp_path,
                         max_restarts=1, kill="1:5:2")  # rank 1 dies in iteration 6 (2 micro-batches per rank)
    assert code == 0, out[-4000:]
    assert "Connection refused" not in out, out[-4000:]
    ref_code, ref = torchrun([str(ROOT / "pretrain_gpt.py"), *FLAGS, "--save", str(tmp_path / "ref")], tmp_path,
                             max_restarts=0)
    assert ref_code == 0, ref[-4000:]
    assert logged(out) == logged(ref) and sorted(logged(ref)) == list(range(1, 9))
    assert (f"> restart: torchrun attempt 2 (TORCHELASTIC_RESTART_COUNT=1): resumed from --load {ck} at iteration 3 "
            "(24 samples); the previous attempt had logged iteration 5: iterations 4-5 are redone") in out, out[-4000:]
    assert read_progress(ck)["iteration"] == 8 and read_progress(ck)["attempt"] == "megazero/requeue0/attempt1"


def test_the_store_prefix_changes_with_the_attempt():
    assert attempt_prefix({}) == "megazero/requeue0/attempt0"
    assert attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "1"}) == "megazero/requeue0/attempt1"
    assert attempt_prefix({"SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "0"}) == "megazero/requeue2/attempt0"
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='x': expected a restart count"):
        attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "x"})


def test_a_restarted_attempt_never_sees_the_killed_attempt_s_keys():
    """torchrun's agent keeps its store across attempts: every rank is its client, and what the
    killed attempt wrote (gloo's addresses) is not visible to the next one."""
    import torch.distributed as dist
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    launch = LaunchEnv(0, 2, 0, 2, "127.0.0.1", agent.port, "torchrun")
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    killed = rendezvous_store(launch, timedelta(seconds=5), {**env, "TORCHELASTIC_RESTART_COUNT": "0"})
    killed.set("default_pg/0//rank_1", "127.0.0.1:1")  # an address nobody listens on any more
    restarted = rendezvous_store(launch, timedelta(seconds=5), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarted.check(["default_pg/0//rank_1"]) and killed.check(["default_pg/0//rank_1"])
    restarted.set("default_pg/0//rank_1", "127.0.0.1:2")
    assert killed.get("default_pg/0//rank_1") == b"127.0.0.1:1"


def test_the_start_up_line_says_what_is_resumed_and_redone(tmp_path):
    ck = str(tmp_path)
    write_progress(ck, 7, 56, env={})
    assert (tmp_path / PROGRESS_NAME).exists() and not list(tmp_path.glob("*.tmp"))
    restarted = {"TORCHELASTIC_RESTART_COUNT": "1"}
    assert resume_line(ck, 6, 48, restarted).endswith("had logged iteration 7: iteration 7 is redone")
    assert resume_line(ck, 7, 56, restarted).endswith("had logged iteration 7: nothing logged is redone")
    assert resume_line(ck, 7, 56, {}) is None  # a first attempt, nothing ahead of its checkpoint
    assert resume_line(ck, 4, 32, {}) == (f"> resume: resumed from --load {ck} at iteration 4 (32 samples); the "
                                          "previous run had logged iteration 7: iterations 5-7 are redone")
    assert resume_line(None, 0, 0, {"SLURM_RESTART_COUNT": "1"}) == (
        "> restart: SLURM requeue 1 (SLURM_RESTART_COUNT=1) without --load: training starts again from iteration 0 "
        "(pass --load = --save to resume)")
    assert "not recorded" in resume_line(str(tmp_path / "none"), 0, 0, restarted)
