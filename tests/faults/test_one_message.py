"""One message per job (issue 30 §4): under ``torchrun --nproc-per-node 2`` a bad flag, a
warning and a failure before the process group are printed once, by rank 0, as one line; every
rank exits with the same status; a missing ``--tokenizer-type`` is a start-up error naming it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.testing import free_port

from tests.faults.common import MOCK, TINY

ROOT = Path(__file__).resolve().parents[2]


def torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--tee", "0", str(ROOT / "pretrain_gpt.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_a_bad_flag_is_one_line_from_rank_0_and_every_rank_exits_2(tmp_path):
    out = torchrun([*TINY, *MOCK, "--train-iters", "2", "--lr", "nan"], tmp_path)
    both = out.stdout + out.stderr
    assert out.returncode != 0
    assert len(lines_with(both, "--lr must be a finite number >= 0, got nan")) == 1, both
    assert "exitcode  : 2" in both or "exit code 2" in both or "exitcode: 2" in both.replace(" ", ""), both


def test_a_warning_is_one_WARNING_line_without_a_source_line(tmp_path):
    out = torchrun([*TINY, *MOCK, "--train-iters", "1", "--sequence-parallel"], tmp_path)
    both = out.stdout + out.stderr
    assert out.returncode == 0, both[-3000:]
    warned = lines_with(both, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    assert warned == ["WARNING: --sequence-parallel needs --tensor-model-parallel-size > 1; turning it off"], both
    assert "UserWarning" not in both and "warnings.warn(" not in both


def test_a_failure_before_the_process_group_is_printed_once(tmp_path):
    missing = tmp_path / "no_such_checkpoint_record"
    missing.mkdir()
    (missing / "latest_checkpointed_iteration.txt").write_text("7\n")  # names an iteration that is not there
    out = torchrun([*TINY, *MOCK, "--train-iters", "1", "--load", str(missing)], tmp_path)
    both = out.stdout + out.stderr
    assert out.returncode != 0
    errors = lines_with(both, ": checkpoint error:") + lines_with(both, ": training failed:")
    assert len(errors) == 1 and errors[0].startswith("rank 0: "), both


def test_no_tokenizer_type_is_a_start_up_error_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*TINY, "--train-iters", "1", "--data-path", str(tmp_path / "x_text_document")],
                   world_size=1, prog="pretrain_gpt.py", training=True)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--tokenizer-type is required to read --data-path (one of GPT2BPETokenizer" in err, err
