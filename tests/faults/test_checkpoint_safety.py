"""No checkpoint lost to a tool or a flag (issue 30 §2): --finetune into the folder it loads,
a tool's output inside a checkpoint or over another file/folder, hand-edited metadata and
pointers, damaged inputs to the converter; each one line, nothing saved changed."""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.checkpoint import files
from megazero.checkpoint.schema import CheckpointError
from tests.faults.common import MOCK, TINY

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import convert_checkpoint as cc  # noqa: E402


def digest(folder) -> dict:
    """Every file under ``folder`` -> its sha256."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained 2 iterations, saved at 2 (NullTokenizer, mock data)."""
    from megazero.training import pretrain
    save = tmp_path_factory.mktemp("safety") / "ck"
    argv = TINY + MOCK + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--save", str(save),
                          "--save-interval", "2"]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 0
    return save


@pytest.fixture
def ck(trained, tmp_path):
    """A private copy of the trained checkpoint (each test may damage its own)."""
    dst = tmp_path / "ck"
    shutil.copytree(trained, dst)
    (dst / "megazero.lock").unlink(missing_ok=True)
    return dst


def test_finetune_into_the_folder_it_loads_is_refused_and_changes_nothing(ck, capsys):
    from megazero.training import pretrain
    before = digest(ck)
    argv = TINY + MOCK + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--load", str(ck),
                          "--save", str(ck), "--finetune"]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 1
    err = capsys.readouterr().err
    assert (f"rank 0: checkpoint error: --finetune with --load and --save both {ck}: the fine-tuning run starts at "
            "iteration 0 and would overwrite the checkpoint it loads") in err, err
    assert digest(ck) == before


def run_tool(argv, capsys) -> tuple[int, str]:
    code = cc.main(argv)
    return code, capsys.readouterr().err


def test_to_fp32_output_inside_the_checkpoint_is_refused(ck, capsys):
    before = digest(ck)
    code, err = run_tool(["to-fp32", "--load", str(ck), "--output", str(ck / "iter_0000002" / "model.pt")], capsys)
    assert code == 1 and err.strip() == (f"checkpoint error: --output {ck}/iter_0000002/model.pt is inside the "
                                         f"checkpoint folder {ck}: writing there could replace its files; choose a "
                                         "path outside it"), err
    assert digest(ck) == before


def test_to_hf_into_a_non_empty_folder_needs_overwrite(ck, tmp_path, capsys):
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    code, err = run_tool(["to-hf", "--load", str(ck), "--output", str(other)], capsys)
    assert code == 1 and err.strip() == (f"checkpoint error: --output {other} is not an empty folder: pass "
                                         "--overwrite to replace it, or choose a new path"), err
    assert (other / "config.json").read_text() == "{}"
    assert run_tool(["to-hf", "--load", str(ck), "--output", str(other), "--overwrite"], capsys)[0] == 0
    assert (other / "model.safetensors").exists()
    out = tmp_path / "fp32.pt"
    assert run_tool(["to-fp32", "--load", str(ck), "--output", str(out)], capsys)[0] == 0
    code, err = run_tool(["to-fp32", "--load", str(ck), "--output", str(out)], capsys)
    assert code == 1 and f"--output {out} exists: pass --overwrite" in err


def test_import_into_a_checkpoint_folder_is_refused(ck, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert run_tool(["to-hf", "--load", str(ck), "--output", str(hf)], capsys)[0] == 0
    code, err = run_tool(["from-hf", "--hf", str(hf), "--save", str(ck / "imported")], capsys)
    assert code == 1 and f"--save {ck}/imported is inside the checkpoint folder {ck}" in err, err
    assert not (ck / "imported").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda m: {**m, "iteration": 99}, "'iteration' is 99 but the folder is iter_0000002"),
    (lambda m: {**m, "index": [1, 2]}, "'index' must be an object with a 'ranks' list"),
    (lambda m: {**m, "iteration": "2"}, "'iteration' must be an integer, found '2'"),
    (lambda m: [m], "expected a JSON object, found list"),
])
def test_hand_edited_metadata_is_named(ck, edit, message):
    path = ck / "iter_0000002" / "metadata.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(CheckpointError) as e:
        files.read_metadata(str(ck), 2)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)


def test_a_negative_pointer_is_named(ck):
    (ck / "latest_checkpointed_iteration.txt").write_text("-4\n")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt: an iteration must be >= 0, found -4"):
        files.latest_iteration(str(ck))


def test_resume_from_hand_edited_metadata_is_one_line_and_trains_nothing_silently(ck, tmp_path, capsys):
    from megazero.training import pretrain
    path = ck / "iter_0000002" / "metadata.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "iteration": 99}))
    argv = TINY + MOCK + ["--train-iters", "4", "--tokenizer-type", "NullTokenizer", "--load", str(ck)]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'iteration' is 99 but the folder is iter_0000002" in err[0], err


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_from_hf_on_damaged_weights_is_one_line(ck, tmp_path, capsys, damage):
    hf = tmp_path / "hf"
    assert run_tool(["to-hf", "--load", str(ck), "--output", str(hf)], capsys)[0] == 0
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"")
    code, err = run_tool(["from-hf", "--hf", str(hf), "--save", str(tmp_path / "out")], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("convert_checkpoint.py from-hf: error: ") or lines[0].startswith("checkpoint error: ")


def test_to_fp32_on_a_truncated_rank_file_is_one_line(ck, tmp_path, capsys):
    rank_file = next((ck / "iter_0000002").glob("*.pt"))
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    code, err = run_tool(["to-fp32", "--load", str(ck), "--output", str(tmp_path / "x.pt")], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(rank_file) in err


def test_the_async_writer_whose_rank_dies_mid_save_prints_one_line(tmp_path, capfd):
    """The rank's end of the socket closes while its writer is writing (a killed rank): the
    writer finishes, cannot answer, and says so in one line instead of a BrokenPipeError."""
    import signal

    import torch

    from megazero.checkpoint.async_writer import AsyncWriter
    writer = AsyncWriter().start()
    os.kill(writer.pid, signal.SIGSTOP)  # it takes the request but cannot act until the rank is gone
    writer.submit(str(tmp_path / "rank_00000.pt"), {"w": torch.arange(1000.0)})
    proc = writer.proc
    writer.sock.close()  # the rank dies
    os.kill(writer.pid, signal.SIGCONT)
    assert proc.wait(timeout=120) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err.strip().splitlines() == [
        f"megazero async checkpoint writer: its training rank exited while {tmp_path}/rank_00000.pt was being written; "
        "that checkpoint is not published (its folder stays *.tmp), the previously published checkpoint is intact"], err


def test_preprocess_output_inside_a_checkpoint_is_refused(ck, tmp_path, capsys):
    import preprocess_data
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2 3"}\n')
    before = digest(ck)
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(ck / "data"), "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", "10"]) == 1
    assert f"--output-prefix {ck}/data is inside the checkpoint folder {ck}" in capsys.readouterr().err
    assert digest(ck) == before


def test_train_tokenizer_output_inside_a_checkpoint_is_refused(ck, tmp_path, capsys):
    import train_tokenizer
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a b c."}\n')
    before = digest(ck)
    assert train_tokenizer.main(["--input", str(src), "--vocab-size", "8", "--output-prefix",
                                 str(ck / "tokenizer" / "tokenizer")]) == 1
    assert f"--output-prefix {ck}/tokenizer/tokenizer is inside the checkpoint folder {ck}" in capsys.readouterr().err
    assert digest(ck) == before
