"""Format 3 at the scale ZeRO-3 is for: each rank writes only what it owns (ZeRO-3 parameter and
optimizer shards; weights kept whole written by DP rank 0 only), nothing is gathered, saving can
run in the background (``--async-save``), the resumed run continues with the uninterrupted
run's losses, another layout loads it, and a range read touches only the bytes asked for."""

import os

import numpy as np
import torch

from megazero.checkpoint import files, schema
from megazero.checkpoint.reader import CheckpointReader
from tests.checkpoint.test_reshard import assert_same_state, run
from tests.test_training import MOCK, TINY, layout_flags, train

# every layer a partitioned stage-3 unit (the tiny model's parameters are all below the default 1e5)
FLAGS = TINY + MOCK + ["--zero-param-persistence-threshold", "0", "--train-iters", "6", "--save-interval", "100"]


def test_zero3_writes_shards_once_async_and_resumes_exactly(tmp_path):
    common = FLAGS + layout_flags(1, 1, None, 3)
    full = train(2, common)
    ck = str(tmp_path / "ck")
    first = train(2, common + ["--save", ck, "--exit-interval", "3", "--async-save"])
    assert files.latest_iteration(ck) == 3
    second = train(2, common + ["--save", ck, "--load", ck, "--async-save"])
    assert [i for i, _ in first + second] == list(range(1, 7))
    assert [l for _, l in first + second] == [l for _, l in full], "resumed run diverged"

    reader = CheckpointReader(ck, 3)
    assert reader.version == schema.DENSE_VERSION == 3  # a dense model: format 3
    for e in reader.ranks:
        state = files.load_rank_state(ck, 3, e["rank"])
        stored = {p[1]: p[4] for p in e["params"]}
        # weights kept whole: DP rank 0 only; every layer weight: a parameter shard on each DP rank
        assert set(state["model"][0]) == {n for n, s in stored.items() if s == schema.STORED_MODEL}
        assert all(s == schema.STORED_SHARD for n, s in stored.items() if n.startswith("layers."))
        if e["dp_rank"] > 0:
            assert not state["model"][0]
        for reg, shard, opt in zip(e["regions"], state["param_shards"], state["optimizer"]["shards"]):
            assert (shard is not None) == reg["partitioned"]
            assert opt["master"].numel() == reg["shard_len"]
            if shard is not None:  # the weights are the masters in params dtype
                assert torch.equal(shard, opt["master"].to(shard.dtype))

    # another layout (TP 2, ZeRO 0) from iteration 3: the same full state, and the same training
    (tmp_path / "ck" / schema.LATEST).write_text("3\n")
    hist = run(2, FLAGS + layout_flags(2, 1, None, 0) + ["--load", ck], save_at_load=str(tmp_path / "tp2"))
    np.testing.assert_allclose([l for _, l in hist], [l for _, l in full][3:], rtol=1e-5)
    assert_same_state(reader, CheckpointReader(str(tmp_path / "tp2")))


def test_zero0_writes_replicas_once_and_ranges_read_only_what_is_asked(tmp_path):
    ck, flags = str(tmp_path / "z0"), FLAGS + layout_flags(1, 1, None, 0) + ["--train-iters", "4"]
    full = train(4, flags + ["--save", ck, "--save-interval", "2"])
    (tmp_path / "z0" / schema.LATEST).write_text("2\n")
    reader = CheckpointReader(ck)
    path = {e["dp_rank"]: schema.rank_file(reader.directory, e["rank"]) for e in reader.ranks}
    assert all(os.path.getsize(path[d]) * 20 < os.path.getsize(path[0]) for d in (1, 2, 3))
    assert_same_state(reader, reader)  # every kind readable from DP rank 0's file
    # exact resume: DP ranks 1-3 read the optimizer replica from DP rank 0's file
    assert run(4, flags + ["--load", ck], train=False) == "exact"
    assert run(4, flags + ["--load", ck]) == full[2:]  # and every replica continues bit for bit
    name = "layers.1.mlp.fc1.weight"
    shape = tuple(reader.full_param(name).shape)
    before = reader.bytes_read
    part = reader.local_range(name, "exp_avg", 0, 1, shape, 10, 74, to_local=None)
    assert reader.bytes_read - before == 64 * 4
    assert torch.equal(part, reader.full_param(name, "exp_avg").reshape(-1)[10:74])
