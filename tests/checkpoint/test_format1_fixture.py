"""Old checkpoints keep loading: ``tests/fixtures/format1_checkpoint`` was saved by commit
2aca939 (format version 1; see tests/fixtures/make_format1_checkpoint.py) in TP 2, DP 2, ZeRO 1
with tied embeddings. Today's code loads it in the same layout (the exact path: rank files as
saved) and in another (TP 1, PP 2, ZeRO 3: resharded, the tied output layer read through the
format-1 alias), and the weights and fp32 masters equal what that commit's reader gave."""

import shutil
from pathlib import Path

import torch

from megazero.checkpoint import files, schema
from megazero.checkpoint.reader import CheckpointReader
from tests.checkpoint.test_reshard import run
from tests.fixtures.make_format1_checkpoint import FLAGS

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format1_checkpoint"


def _layout(flags, tp, pp, zero):
    out = list(flags)
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--zero-stage", zero)):
        out[out.index(flag) + 1] = str(value)
    return out


def _check_against_expected(saved_dir):
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    reader = CheckpointReader(str(saved_dir))
    assert reader.metadata["index"]["version"] == schema.DENSE_VERSION  # re-saved dense: format 3
    assert (reader.iteration, reader.metadata["consumed_samples"]) == (2, 16)
    assert reader.param_names() == list(expected)
    for name, kinds in expected.items():
        for kind, tensor in kinds.items():
            assert torch.equal(reader.full_param(name, kind), tensor), f"{name} {kind}"
    return reader


def test_format1_fixture_loads_exact_and_resharded(tmp_path):
    src = tmp_path / "old"
    shutil.copytree(FIXTURE, src)
    assert files.read_metadata(str(src), 2)["index"]["version"] == 1
    path = run(4, FLAGS + ["--load", str(src)], save_at_load=str(tmp_path / "same"), train=False)
    assert path == "exact"
    _check_against_expected(tmp_path / "same")
    ranks = CheckpointReader(str(tmp_path / "same")).ranks
    for rank in range(4):  # the exact path restores every rank's file as it was saved
        old, new = files.load_rank_state(str(src), 2, rank), files.load_rank_state(str(tmp_path / "same"), 2, rank)
        # format 3 writes the weights once, from DP rank 0 of each TP rank
        assert new["model"][0].keys() == (old["model"][0].keys() if ranks[rank]["dp_rank"] == 0 else set())
        assert all(torch.equal(old["model"][0][k], new["model"][0][k]) for k in new["model"][0])
        for a, b in zip(old["optimizer"]["shards"], new["optimizer"]["shards"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert old["counters"] == new["counters"]
        # the format-1 schedule counted iterations; it is re-saved in samples (global batch 8)
        b, sched = 8, old["scheduler"]
        assert new["scheduler"] == dict(sched, unit="samples", init_lr=0.0, num_steps=sched["num_steps"] * b,
                                        warmup_iters=sched["warmup_iters"] * b, decay_iters=sched["decay_iters"] * b)

    flags = _layout(FLAGS, 1, 2, 3)
    path = run(2, flags + ["--load", str(src)], save_at_load=str(tmp_path / "other"), train=False)
    assert path == "resharded"
    reader = _check_against_expected(tmp_path / "other")
    assert reader.layout["pipeline_model_parallel_size"] == 2
    assert reader.aliases == {"output_layer.weight": "embedding.word_embeddings.weight"}
