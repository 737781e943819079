"""Runtime failures: one line naming the file and the cause, exit status 1, the traceback only
with --debug (or MEGAZERO_DEBUG=1); a full disk during a save keeps the previous checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.config.failures import debug_requested, describe
from megazero.training.restart import PROGRESS_NAME
from tests.faults.common import MOCK, TINY, on_tiny_disk, with_file_size_limit

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = str(ROOT / "pretrain_gpt.py")


def _pretrain_in_process(argv):
    from megazero.training import pretrain
    return pretrain(parse_args(argv, world_size=1, prog="pretrain_gpt.py", training=True))


def test_an_os_error_at_run_time_is_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    argv = TINY + MOCK + ["--train-iters", "1", "--pipeline-trace", str(tmp_path / "file" / "trace.json")]
    assert _pretrain_in_process(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rank 0: training failed: {tmp_path}/file/trace.json: not a directory (ENOTDIR) "
                   "[--debug or MEGAZERO_DEBUG=1 for the traceback]"], err
    assert _pretrain_in_process(argv + ["--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "NotADirectoryError" in err


def test_debug_switches_and_wrapped_os_errors():
    assert debug_requested(env={"MEGAZERO_DEBUG": "1"}) and debug_requested(True, env={})
    assert not debug_requested(env={"MEGAZERO_DEBUG": "0"}) and not debug_requested(env={})
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:  # torch.save's zip writer on a full disk, as measured
        assert describe(e, default_file="ck/rank_00000.pt").startswith(
            "ck/rank_00000.pt: no space left on device (ENOSPC: free some space, or write elsewhere); RuntimeError")
    err = OSError(27, "File too large")
    err.filename = "out.bin"
    assert describe(err) == "out.bin: file too large (EFBIG: a file-size limit (ulimit -f) or the file system's largest file)"


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A 800 KiB tmpfs: the first checkpoint (~0.5 MiB) fits, the second does not (ENOSPC)."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir(), kept.mkdir()
    cmd = on_tiny_disk(str(disk), str(kept), 800, [sys.executable, PRETRAIN, *TINY, *MOCK, "--train-iters", "3",
                                                   "--save", str(disk / "ck"), "--save-interval", "1"])
    if cmd is None:
        pytest.skip("no mount namespace here (not root); the file-size-limit test covers the message")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"rank 0: checkpoint error: saving {disk}/ck/iter_0000002 failed") and (
        "no space left on device" in line), line
    assert (kept / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    kept_files = sorted(p.name for p in (kept / "ck").iterdir() if p.name != PROGRESS_NAME)  # the log lines' record
    assert kept_files == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    from megazero.checkpoint.reader import CheckpointReader
    assert CheckpointReader(str(kept / "ck")).iteration == 1  # the kept checkpoint reads


def test_file_size_limit_during_the_first_save(tmp_path):
    """EFBIG (a quota, ``ulimit -f``): one line naming the checkpoint, no half-written folder."""
    ck = tmp_path / "ck"
    cmd = with_file_size_limit(300_000, PRETRAIN) + [*TINY, *MOCK, "--train-iters", "1", "--save", str(ck)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"rank 0: checkpoint error: saving {ck}/iter_0000001 failed (rank 0: "), line
    assert line.endswith("latest_checkpointed_iteration.txt still names the previous checkpoint"), line
    assert "file too large (EFBIG" in line and ".partial" in line, line  # the rank file and the cause
    assert [n for n in os.listdir(ck) if n != PROGRESS_NAME] == []  # no iter_*.tmp, no pointer; the lock released


def test_a_missing_load_folder_starts_from_scratch_or_exits_when_told(tmp_path, capsys):
    """Megatron's requeue scripts: the first run's --load does not exist yet."""
    argv = TINY + MOCK + ["--train-iters", "1", "--load", str(tmp_path / "nock")]
    with pytest.raises(SystemExit) as exc:  # sys.exit(), as Megatron's load_checkpoint
        _pretrain_in_process(argv + ["--exit-on-missing-checkpoint"])
    assert exc.value.code in (0, None)
    assert f">> no checkpoint in --load {tmp_path}/nock and --exit-on-missing-checkpoint is set: exiting" in (
        capsys.readouterr().out)
    assert _pretrain_in_process(argv) == 0
    assert f"no latest_checkpointed_iteration.txt in {tmp_path}/nock: starting from scratch" in capsys.readouterr().out
