"""Resharding on --load: a checkpoint saved in one (TP, PP, VP, DP, ZeRO, dtype) layout loads into
another with the same full weights, fp32 masters and Adam moments, and training continues with
the losses of the uninterrupted run (fp32, dropout off, rtol 1e-5)."""

import shutil

import numpy as np
import pytest
import torch

from megazero.checkpoint import schema
from megazero.arguments import parse_args
from megazero.checkpoint.reader import KINDS, CheckpointReader
from megazero.testing import run_distributed
from tests.test_training import MOCK, TINY, layout_flags

BASE = TINY + MOCK + ["--train-iters", "6"]


def _run(rank, world_size, argv, save_at_load=None, train=True):
    """setup (which loads), optionally save right after loading (to inspect), then train."""
    import signal

    from megazero.training.signals import ExitSignal
    from megazero.training import setup
    from megazero.training.build import build_configs
    args = parse_args(argv, world_size=world_size)
    trainer = setup(args)
    if save_at_load:  # the same trainer, saving to another folder
        config = trainer.config
        trainer.config = build_configs(args.replace(save=save_at_load))
        trainer.save()
        trainer.config = config
    if train:
        trainer.train(ExitSignal.install((signal.SIGUSR1,)))
        return trainer.history
    return getattr(trainer, "load_path", None)


def run(world, argv, **kw):
    return run_distributed(_run, world, argv, timeout_s=240, **kw)[-1]


def train_reference(tmp_path, name, world, flags):
    """6 iterations in one layout, saving at 3; the pointer is set back to 3 for loading."""
    root = tmp_path / name
    hist = run(world, flags + ["--save", str(root), "--save-interval", "3"])
    (root / schema.LATEST).write_text("3\n")
    return root, [l for _, l in hist]


def assert_same_state(a: CheckpointReader, b: CheckpointReader, kinds=KINDS):
    assert a.param_names() == b.param_names()
    for name in a.param_names():
        for kind in kinds:
            x, y = a.full_param(name, kind), b.full_param(name, kind)
            assert x.shape == y.shape and torch.equal(x, y), f"{name} {kind}: max diff {(x - y).abs().max()}"
    assert a.optimizer_counters()["iteration"] == b.optimizer_counters()["iteration"]


def world_of(tp, pp, dp):
    return tp * pp * dp


def test_reshard_chain(tmp_path):
    """(2,2,2,2,1) -> (1,1,-,4,3) -> (4,2,-,1,0) -> (2,1,-,2,2) -> (1,2,2,2,1), each from the
    previous one's load (iteration 3); vocab padding differs (256, 128, 512, 256, 128 rows)."""
    chain = [(2, 2, 2, 2, 1), (1, 1, None, 4, 3), (4, 2, None, 1, 0), (2, 1, None, 2, 2), (1, 2, 2, 2, 1)]
    tp, pp, vp, dp, z = chain[0]
    src, ref = train_reference(tmp_path, "A", world_of(tp, pp, dp), BASE + layout_flags(tp, pp, vp, z))
    first = CheckpointReader(str(src), 3)
    for i, (tp, pp, vp, dp, z) in enumerate(chain[1:]):
        dst = tmp_path / f"L{i}"
        hist = run(world_of(tp, pp, dp), BASE + layout_flags(tp, pp, vp, z) + ["--load", str(src)],
                   save_at_load=str(dst))
        assert [it for it, _ in hist] == [4, 5, 6]
        np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5, err_msg=f"after loading into {chain[i + 1]}")
        loaded = CheckpointReader(str(dst))
        assert_same_state(first, loaded)
        assert loaded.layout["tensor_model_parallel_size"] == tp
        src = dst
    assert_tp_change_reads_rows(first, 4)


def assert_tp_change_reads_rows(saved: CheckpointReader, tp: int) -> None:
    """Each TP rank of another TP size gets ``to_local`` of the full tensor, bit for bit, while
    reading only saved rows it needs: at most twice its share (a column split reads whole rows of
    the saved pieces that hold its columns), never the whole parameter."""
    splits = {p.name: p.split for e in saved.ranks for p in schema.entry_params(e)}
    for rank in range(tp):
        reader, share = CheckpointReader(saved.root, saved.iteration), 0
        for name in reader.param_names():
            split = splits[reader.resolve(name)]

            def cut(full, split=split):
                return full if split is None else split.to_local(full, rank, tp)
            local = cut(reader.full_meta(name, "master"))
            got = reader.local_range(name, "master", rank, tp, tuple(local.shape), 0, local.numel(), to_local=cut)
            assert torch.equal(got, cut(saved.full_param(name, "master")).reshape(-1)), name
            share += local.numel() * 4
        assert 0 < reader.bytes_read <= 2 * share, (rank, reader.bytes_read, share)


def test_dp2_to_dp3_uneven_shards(tmp_path):
    flags = TINY + MOCK + ["--train-iters", "6", "--micro-batch-size", "1", "--global-batch-size", "6"]
    src, ref = train_reference(tmp_path, "A", 2, flags + layout_flags(1, 1, None, 1))
    hist = run(3, flags + layout_flags(1, 1, None, 1) + ["--load", str(src)], save_at_load=str(tmp_path / "B"))
    np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5)
    b = CheckpointReader(str(tmp_path / "B"))
    assert b.layout["data_parallel_size"] == 3
    assert_same_state(CheckpointReader(str(src), 3), b)


def test_fp32_to_bf16_and_no_load_optim(tmp_path):
    src, _ = train_reference(tmp_path, "A", 2, BASE + layout_flags(2, 1, None, 1))
    a = CheckpointReader(str(src), 3)
    # fp32 -> bf16 (ZeRO 3, PP 2): masters and moments exact, weights = bf16(master)
    hist = run(2, BASE + layout_flags(1, 2, None, 3) + ["--bf16", "--load", str(src)], save_at_load=str(tmp_path / "B"))
    assert len(hist) == 3 and all(np.isfinite(l) for _, l in hist)
    b = CheckpointReader(str(tmp_path / "B"))
    assert_same_state(a, b, kinds=("master", "exp_avg", "exp_avg_sq"))
    for name in a.param_names():
        assert torch.equal(b.full_param(name), a.full_param(name, "master").to(torch.bfloat16)), name
    # --no-load-optim in another layout: weights only; masters = weights, moments and step zero
    run(2, BASE + layout_flags(1, 1, None, 2) + ["--load", str(src), "--no-load-optim"],
        save_at_load=str(tmp_path / "C"), train=False)
    c = CheckpointReader(str(tmp_path / "C"))
    # the same layout takes the exact path (this rank's file as saved, RNG included)
    assert run(2, BASE + layout_flags(2, 1, None, 1) + ["--load", str(src)], train=False) == "exact"
    assert c.optimizer_counters()["iteration"] == 0
    for name in a.param_names():
        assert torch.equal(c.full_param(name), a.full_param(name)), name
        assert torch.equal(c.full_param(name, "master"), a.full_param(name))
        assert not c.full_param(name, "exp_avg").any() and not c.full_param(name, "exp_avg_sq").any()


def test_reader_errors_name_the_file(tmp_path):
    src, _ = train_reference(tmp_path, "A", 2, BASE + ["--train-iters", "3"] + layout_flags(2, 1, None, 0))
    name = "layers.0.mlp.fc1.weight"
    full = CheckpointReader(str(src)).full_param(name)
    assert full.shape == (128, 32)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "iter_0000003" / "rank_00001.pt"
    f.unlink()
    with pytest.raises(schema.CheckpointError, match="rank_00001.pt is missing"):
        CheckpointReader(str(bad)).full_param(name)
    f.write_bytes((src / "iter_0000003" / "rank_00001.pt").read_bytes()[:5000])
    with pytest.raises(schema.CheckpointError, match="rank_00001.pt cannot be read"):
        CheckpointReader(str(bad)).full_param(name)
    import argparse
    torch.save({"obj": argparse.Namespace(a=1)}, f)  # a pickle that would build an arbitrary object
    with pytest.raises(schema.CheckpointError, match="rank_00001.pt cannot be read"):
        CheckpointReader(str(bad)).full_param(name, "master")
    (bad / "iter_0000003" / "metadata.json").unlink()
    with pytest.raises(schema.CheckpointError, match="metadata.json is missing"):
        CheckpointReader(str(bad))
