"""Engine checkpoints are written as the trainer's (megazero/checkpoint/files.py): a save that
fails on one rank raises on every rank naming it and leaves ``latest`` and the earlier tag as they
were; re-saving a tag replaces it whole; a newer engine format is refused by its version."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing import run_distributed

from .test_engine_api import _data, _mlp
from .test_engine_checkpoint import _cfg, _run


def _save_then_fail(rank, world, data, folder):
    import megazero
    from megazero.checkpoint import CheckpointError
    engine, *_ = megazero.initialize(model=_mlp(), config=_cfg(2, 1))
    _run(engine, data[0][rank])
    engine.save_checkpoint(folder, "good", client_state={"step": 1})
    _run(engine, data[1][rank])
    try:  # rank 0's client state cannot be pickled: its write fails after every rank file is written
        engine.save_checkpoint(folder, "bad", client_state={"f": (lambda: 0) if rank == 0 else 0})
    except CheckpointError as e:
        failed = str(e)
    else:
        failed = None
    engine.save_checkpoint(folder, "good", client_state={"step": 2})  # the same tag again: replaced whole
    return failed


def test_a_failed_engine_save_keeps_the_previous_checkpoint(tmp_path):
    data = _data(2)
    for failed in run_distributed(_save_then_fail, 2, data, str(tmp_path), timeout_s=120):
        assert failed is not None and "rank 0:" in failed and "client_state.pt" in failed, failed
        assert "engine.save_checkpoint" in failed and "as they were" in failed
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]
    assert (tmp_path / "latest").read_text() == "good"
    assert sorted(os.listdir(tmp_path / "good")) == ["client_state.pt", "engine_meta.json", "module_buffers.pt",
                                                     "zero_rank_00000.pt", "zero_rank_00001.pt"]
    from megazero.checkpoint.engine import consolidated_state_dict, resolve
    _, meta = resolve(str(tmp_path), None)
    assert meta["global_steps"] == 2 * len(data[0][0]) and consolidated_state_dict(str(tmp_path))  # the re-save


def test_a_newer_engine_format_is_refused_by_version(tmp_path):
    from megazero.checkpoint.engine import resolve
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "engine_meta.json").write_text(json.dumps({"format": "megazero-engine-9"}))
    with pytest.raises(ValueError, match="engine format version 9; this megazero reads versions 1"):
        resolve(str(tmp_path), "t")
    (folder / "engine_meta.json").write_text(json.dumps({"format": "deepspeed"}))
    with pytest.raises(ValueError, match="has format 'deepspeed'"):
        resolve(str(tmp_path), "t")
