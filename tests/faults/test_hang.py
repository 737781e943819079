"""No hang: a stopped rank is named and every other rank exits non-zero within the timeout plus a
few seconds, leaving the last checkpoint intact; SIGTERM ends a rank blocked in C."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.testing import RankFailure, run_distributed
from tests.faults.common import MOCK, TINY

ROOT = Path(__file__).resolve().parents[2]
STOP_AFTER_CALLS = 40  # forward steps of rank 2 (4 micro-batches per iteration): a few iterations in


def _stalls(rank, world_size, argv, stamp):
    from megazero.model.stages import gpt_forward_step
    from megazero.training import pretrain
    calls = []

    def forward_step(chunk, micro_batch, input_tensor):
        calls.append(1)
        if rank == 2 and len(calls) == STOP_AFTER_CALLS:
            Path(stamp).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # a wedged GPU / NFS mount behaves alike
        return gpt_forward_step(chunk, micro_batch, input_tensor)

    code = pretrain(parse_args(argv, world_size=world_size), forward_step_func=forward_step)
    os._exit(code)  # as the script would: the exit status is what the launcher sees


def test_stopped_rank_is_named_and_nobody_hangs(tmp_path, capfd):
    save = tmp_path / "ck"
    argv = TINY + MOCK + ["--train-iters", "100000", "--save", str(save), "--save-interval", "2",
                          "--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.2",
                          "--log-interval", "1000"]
    stamp = tmp_path / "stopped_at"
    with pytest.raises(RankFailure) as exc:
        run_distributed(_stalls, 4, argv, str(stamp), timeout_s=400, grace_s=25, collective_timeout_s=12,
                        heartbeat_s=12)
    elapsed = time.time() - float(stamp.read_text())
    message = str(exc.value)
    assert elapsed < 60, f"{elapsed:.0f} s from SIGSTOP to every process gone"
    for r in (0, 1, 3):  # each survivor exited by itself, non-zero
        assert re.search(rf"rank {r} died without reporting \(exit code [1-9]", message), message
    assert "ranks [2] were still running" in message  # only the stopped one had to be killed
    assert "rank 2 has sent no heartbeat" in capfd.readouterr().err
    it = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert it >= 2 and it % 2 == 0
    from megazero.checkpoint.reader import CheckpointReader
    reader = CheckpointReader(str(save))
    assert all(t.isfinite().all() for _, t in reader.iter_full_params())


BLOCKED = r"""
import signal, sys, time
from datetime import timedelta
import torch.distributed as dist
sys.path.insert(0, {root!r})
from megazero.parallel.heartbeat import Heartbeat
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
Heartbeat("127.0.0.1", store.port, 0, 2, timeout_s=600, interval_s=0.2, grace_s=1).start()
signal.signal(signal.SIGTERM, lambda *a: print("handler ran", flush=True))
print("blocking", flush=True)
store.wait(["never"], timedelta(seconds=120))  # blocked in C, as in a collective
"""


def test_sigterm_ends_a_blocked_rank():
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED.format(root=str(ROOT))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "blocking"
    time.sleep(0.5)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.time() - t0 < 30
    assert "SIGTERM received while blocked" in err


def _group_timeout(rank, world_size):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megazero.parallel.topology import Topology
    topo = Topology(world_size, rank).create_groups(timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(8)
        return None
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(1), group=topo.dp_group)
    except RuntimeError as e:
        return time.time() - t0, str(e)
    return None


def test_every_group_has_the_run_timeout():
    """The default group waits 60 s here; the DP group must give up after its own 2 s."""
    waited, error = run_distributed(_group_timeout, 2, timeout_s=120, collective_timeout_s=60)[0]
    assert waited < 7 and "Timed out" in error, (waited, error)
