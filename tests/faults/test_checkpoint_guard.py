"""No checkpoint lost: --save folders of other runs are refused, a second concurrent run is locked
out, stale locks are taken over, imports refuse non-empty targets, stale .tmp folders go."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megazero.checkpoint import CheckpointError
from megazero.checkpoint import files
from megazero.checkpoint.guard import LOCK_NAME, claim_lock, guard_save_dir, release_lock
from tests.faults.common import MOCK, TINY

ROOT = Path(__file__).resolve().parents[2]


def _fake_checkpoint(folder: Path, iteration: int = 3) -> None:
    (folder / f"iter_{iteration:07d}").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_save_into_another_runs_checkpoints_is_refused(tmp_path):
    ck = tmp_path / "ck"
    _fake_checkpoint(ck)
    with pytest.raises(CheckpointError, match="--overwrite-checkpoints"):
        guard_save_dir(str(ck), None, False, rank=1)
    with pytest.raises(CheckpointError, match="does not load from"):
        guard_save_dir(str(ck), str(tmp_path / "other"), False, rank=1)
    guard_save_dir(str(ck), str(ck) + "/", False, rank=1)  # resuming from it: fine
    guard_save_dir(str(ck), None, True, rank=1)  # told so
    guard_save_dir(str(tmp_path / "new" / "deep"), None, False, rank=1)  # created
    assert (tmp_path / "new" / "deep").is_dir()


def test_save_must_be_a_writable_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        guard_save_dir(str(tmp_path / "file"), None, False, rank=0)
    with pytest.raises(CheckpointError, match="not writable"):
        guard_save_dir("/proc/megazero-ck", None, False, rank=0)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="not writable"):
            guard_save_dir(str(ro / "ck"), None, False, rank=0)


def test_lock_refuses_a_live_run_and_takes_over_a_dead_one(tmp_path):
    lock = tmp_path / LOCK_NAME
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{socket.gethostname()} {live.pid} 0\n")  # old stamp, but its process lives
        os.utime(lock)
        with pytest.raises(CheckpointError, match=f"another run \\(process {live.pid}"):
            claim_lock(str(tmp_path))
    finally:
        live.kill()
        live.wait()
    lines = []
    path = claim_lock(str(tmp_path), print_fn=lines.append)
    assert "taking over the stale checkpoint lock" in lines[0] and f"process {live.pid}" in lines[0]
    assert lock.read_text().split()[1] == str(os.getpid())
    assert claim_lock(str(tmp_path)) == path  # the same process again: fine
    release_lock(path)
    assert not lock.exists()


def test_next_save_removes_stale_tmp_folders(tmp_path):
    root = tmp_path / "ck"
    (root / "iter_0000004.tmp").mkdir(parents=True)  # a run killed mid-save
    (root / "iter_0000004.tmp" / "rank_00000.pt").write_text("partial")
    files.save_checkpoint(str(root), 2, 0, {"x": 1}, {"iteration": 2})
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_from_hf_refuses_a_non_empty_target(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import convert_checkpoint
    finally:
        sys.path.remove(str(ROOT / "tools"))
    ck = tmp_path / "run"
    _fake_checkpoint(ck)
    assert convert_checkpoint.main(["from-hf", "--hf", str(tmp_path / "hf"), "--save", str(ck)]) == 1
    assert f"--save {ck} holds a checkpoint: writing there could replace its files" in capsys.readouterr().err
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3\n"


def test_pretrain_refuses_before_any_work(tmp_path):
    ck = tmp_path / "ck"
    _fake_checkpoint(ck)
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, *MOCK, "--train-iters", "2", "--save", str(ck)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and "--overwrite-checkpoints" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "iteration" not in out.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_second_concurrent_run_on_one_folder_is_refused(tmp_path):
    ck = tmp_path / "ck"
    base = [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, *MOCK, "--save", str(ck)]
    first = subprocess.Popen(base + ["--train-iters", "100000", "--log-interval", "100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not (ck / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert (ck / LOCK_NAME).exists()
        second = subprocess.run(base + ["--train-iters", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert second.returncode == 1 and f"another run (process {first.pid}" in second.stderr, second.stderr[-2000:]
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()


def test_a_failed_save_says_when_the_disk_is_full(tmp_path):
    from megazero.checkpoint.guard import space_hint
    assert space_hint(str(tmp_path / "ck" / "iter_0000001.tmp")) == ""  # plenty free here
    hint = space_hint(str(tmp_path / "ck" / "iter_0000001.tmp"), min_free=1 << 62)
    assert hint.startswith(" (no space left on device: ") and str(tmp_path) in hint


def test_a_requeued_slurm_job_takes_over_its_own_lock(tmp_path):
    """The earlier attempt ran on another node (its pid cannot be checked from here)."""
    env = dict(os.environ, SLURM_JOB_ID="4242")
    (tmp_path / LOCK_NAME).write_text(f"other-node 1 {time.time():.0f} 4242\n")
    code = ("import sys; from megazero.checkpoint.guard import claim_lock; "
            f"claim_lock({str(tmp_path)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "earlier attempt of SLURM job 4242" in out.stdout, out.stderr
    env["SLURM_JOB_ID"] = "99"
    (tmp_path / LOCK_NAME).write_text(f"other-node 1 {time.time():.0f} 4242\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and "another run (process 1 on other-node)" in out.stderr


def test_a_restarted_torchrun_takes_over_its_own_lock(tmp_path):
    """torchrun --max-restarts: the earlier attempt's rank 0 may have run on another node."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    env.update(TORCHELASTIC_RUN_ID="r1", MASTER_ADDR="node0", MASTER_PORT="29500")
    code = ("import sys; from megazero.checkpoint.guard import claim_lock; "
            f"claim_lock({str(tmp_path)!r})")
    for port, taken in (("29500", True), ("29501", False)):  # another port: another launch, live
        (tmp_path / LOCK_NAME).write_text(f"other-node 1 {time.time():.0f} torchrun:r1@node0:{port}\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=60)
        if taken:
            assert out.returncode == 0 and "earlier attempt of torchrun:r1@node0:29500" in out.stdout, out.stderr
        else:
            assert out.returncode == 1 and "another run (process 1 on other-node)" in out.stderr
