"""Atomic checkpoint protocol: the pointer is written last, a rank killed mid-save harms nothing,
corrupt or mismatched checkpoints are named, and files load with weights_only=True."""

import argparse
import json
import os
import signal

import pytest
import torch

from megazero.checkpoint import files as ckpt
from megazero.checkpoint import schema
from megazero.testing import RankFailure, run_distributed

LAYOUT = {"world_size": 2, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 2, "zero_stage": 1,
          "params_dtype": "float32"}


def _save(rank, world_size, root, iteration, die_rank):
    state = {"w": torch.full((3,), float(iteration * 10 + rank)), "step": iteration}
    if rank == die_rank:
        # write a partial file, then die before the barrier that publishes the checkpoint
        os.makedirs(schema.iteration_dir(root, iteration) + ".tmp", exist_ok=True)
        with open(schema.rank_file(schema.iteration_dir(root, iteration) + ".tmp", rank), "wb") as f:
            f.write(b"PK\x03\x04 half")
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save_checkpoint(root, iteration, rank, state, {"iteration": iteration, "layout": LAYOUT})
    return True


def test_killed_rank_during_save_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    run_distributed(_save, 2, root, 1, -1)
    assert ckpt.latest_iteration(root) == 1
    with pytest.raises(RankFailure):
        run_distributed(_save, 2, root, 2, 1, grace_s=3, collective_timeout_s=10)
    assert ckpt.latest_iteration(root) == 1
    assert not os.path.exists(schema.iteration_dir(root, 2))
    for rank in range(2):
        assert torch.equal(ckpt.load_rank_state(root, 1, rank)["w"], torch.full((3,), 10.0 + rank))
    run_distributed(_save, 2, root, 2, -1)  # the next save clears the stale .tmp folder
    assert ckpt.latest_iteration(root) == 2 and not os.path.exists(schema.iteration_dir(root, 2) + ".tmp")
    run_distributed(_save, 2, root, 2, -1)  # re-saving the same iteration replaces it
    assert ckpt.read_metadata(root, 2)["iteration"] == 2


def test_errors_name_the_file(tmp_path):
    root = str(tmp_path)
    assert ckpt.latest_iteration(root) is None
    (tmp_path / schema.LATEST).write_text("banana")
    with pytest.raises(schema.CheckpointError, match="latest_checkpointed_iteration.txt.*'banana'"):
        ckpt.latest_iteration(root)
    d = tmp_path / "iter_0000005"
    d.mkdir()
    with pytest.raises(schema.CheckpointError, match="iter_0000005/metadata.json is missing"):
        ckpt.read_metadata(root, 5)
    (d / "metadata.json").write_text(json.dumps({"layout": LAYOUT}))
    with pytest.raises(schema.CheckpointError, match="rank_00000.pt is missing"):
        ckpt.load_rank_state(root, 5, 0)
    torch.save({"x": torch.ones(1000)}, d / "rank_00000.pt")
    data = (d / "rank_00000.pt").read_bytes()
    (d / "rank_00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(schema.CheckpointError, match="rank_00000.pt cannot be read"):
        ckpt.load_rank_state(root, 5, 0)
    torch.save({"obj": argparse.Namespace(a=1)}, d / "rank_00001.pt")  # arbitrary pickled object
    with pytest.raises(schema.CheckpointError, match="rank_00001.pt cannot be read"):
        ckpt.load_rank_state(root, 5, 1)
    now = dict(LAYOUT, tensor_model_parallel_size=2, data_parallel_size=1)
    with pytest.raises(schema.CheckpointError, match="tensor_model_parallel_size saved 1 vs now 2; "
                                                   "data_parallel_size saved 2 vs now 1"):
        ckpt.check_layout(LAYOUT, now, str(d))


# --async-save (the writer process): tests/checkpoint/test_async_save.py
