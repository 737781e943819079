"""``--load`` of a Megatron-LM ``torch_dist`` folder (tests/checkpoint/megatron_dist_format.py)
straight into a megazero run (megazero/checkpoint/torch_dist.py): at two layouts it trains with
the losses of the same checkpoint converted by ``from-megatron`` and loaded; Megatron's iteration
and consumed samples; ``--use-checkpoint-args``; bad input refused in one line, the source
untouched."""
import os

import numpy as np
import pytest

from megazero.arguments import parse_args
from megazero.checkpoint.schema import CheckpointError
from megazero.checkpoint.torch_dist import saved_args
from megazero.model.config import SHAPE_KEYS
from megazero.testing import run_distributed
from tests.checkpoint.megatron_dist_format import write_torch_dist_checkpoint
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_megatron_dist_import import snapshot
from tests.checkpoint.test_megatron_import import GPT2ISH, LLAMAISH, direct_model
from tests.checkpoint.test_reshard import run
from tests.test_training import TINY, layout_flags


def flags_of(config, iters=10):
    model = [f.strip("'\"") for f in tool().pretrain_flags(config).split()]  # shell quotes off
    return TINY + ["--mock-data", "--train-iters", str(iters), "--seq-length", str(config.seq_length)] + model


def converted_losses(tmp_path, src, config, flags, world=1, layout=(1, 1, None, 0)):
    """The from-megatron path: convert, then --load the megazero folder."""
    tool().from_megatron(src, str(tmp_path / "mz"), vocab_size=config.vocab_size)
    return run(world, flags + ["--load", str(tmp_path / "mz")] + layout_flags(*layout))


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_torch_dist_loads_at_two_layouts_as_the_converted_run(tmp_path, capfd, style):
    """Llama-style (GQA, SwiGLU, untied) and GPT-2-style (tied embeddings, biases, learned
    positions), with Megatron's optimizer entries present (not read): TP 2 (ZeRO 1) and PP 2 x DP 2
    (ZeRO 3), or TP 2 x PP 2 (the tied embedding's copy on the last stage), give iterations 8-10
    with the converted run's losses."""
    model = direct_model(LLAMAISH if style == "llama" else GPT2ISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, iteration=7,
                                      optimizer=True)
    before = snapshot(src)
    flags = flags_of(model.config)
    ref = converted_losses(tmp_path, src, model.config, flags)
    assert [i for i, _ in ref] == [8, 9, 10]
    layouts = ((2, (2, 1, None, 1)), (4, (1, 2, None, 3))) if style == "llama" else ((4, (2, 2, None, 0)),)
    for world, layout in layouts:
        hist = run(world, flags + ["--load", src] + layout_flags(*layout))
        assert [i for i, _ in hist] == [8, 9, 10]
        np.testing.assert_allclose([l for _, l in hist], [l for _, l in ref], rtol=1e-5)
    assert snapshot(src) == before
    out = capfd.readouterr().out
    assert f"(iteration 7, consumed samples 0) into topo.tp={layout[0]}, topo.pp={layout[1]}" in out
    assert "optimizer.* entries) was not read, --no-load-optim implied" in out


def test_moe_torch_dist_loads_at_ep2(tmp_path):
    """Routed experts stacked ``[L, E, ...]``, router expert bias (a persistent buffer), gated
    shared expert: EP 2 gives the converted run's (EP 1) losses."""
    from tests.checkpoint.test_megatron_moe_import import moe_model
    model, full = moe_model()
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), full, model.config)
    flags = flags_of(model.config, iters=9)
    ref = converted_losses(tmp_path, src, model.config, flags)
    hist = run(2, flags + ["--load", src, "--expert-model-parallel-size", "2"] + layout_flags(1, 1, None, 1))
    assert [i for i, _ in hist] == [8, 9]
    np.testing.assert_allclose([l for _, l in hist], [l for _, l in ref], rtol=1e-5)


def _loaded(rank, world_size, argv):
    from megazero.training import setup
    trainer = setup(parse_args(argv, world_size=world_size))
    return trainer.iteration, trainer.consumed_samples, trainer.load_path


def test_counters_checkpoint_args_and_bad_input(tmp_path, capfd):
    model = direct_model(LLAMAISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, iteration=7,
                                      consumed_train_samples=56)
    flags = flags_of(model.config) + ["--load", src]
    assert run_distributed(_loaded, 1, flags, timeout_s=120)[0] == (7, 56, "torch_dist")
    assert "it holds no optimizer state; the LR scheduler starts afresh" in capfd.readouterr().out

    # --use-checkpoint-args: the model flags from Megatron's saved args (pretrain_gpt.py's reader)
    base = ["--load", src, "--use-checkpoint-args", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "100"]
    from megazero.config.model import gpt_config
    got, want = gpt_config(parse_args(base, world_size=1, read_saved=saved_args)).to_args(1), model.config.to_args(1)
    assert {k: got.get(k) for k in SHAPE_KEYS} == {k: want.get(k) for k in SHAPE_KEYS}
    with pytest.raises(SystemExit):  # without the reader: one line saying who reads it
        parse_args(base, world_size=1)
    assert "is a Megatron-LM torch_dist checkpoint, whose arguments pretrain_gpt.py reads" in capfd.readouterr().err

    # another model on the command line: each flag named, before any process group
    from megazero.training.build import build_configs
    with pytest.raises(CheckpointError, match=r"--ffn-hidden-size: command line 64, checkpoint 48"):
        build_configs(parse_args(flags + ["--ffn-hidden-size", "64"], world_size=1))

    # a missing shard: one line naming the file, on load; the source untouched
    before = snapshot(src)
    os.remove(os.path.join(src, "iter_0000007", "__0_0.distcp"))
    with pytest.raises(Exception, match=r"iter_0000007/__0_0\.distcp is missing"):
        run_distributed(_loaded, 1, flags, timeout_s=120)
    assert snapshot(src) == [s for s in before if s[1] != "__0_0.distcp"]

    # a model megazero cannot build: the file and the option, in one line
    bad = write_torch_dist_checkpoint(str(tmp_path / "qk"), model.full_state_dict(), model.config,
                                      rotary_interleaved=True)
    with pytest.raises(CheckpointError, match=r"iter_0000007/common.pt: unsupported Megatron-LM model options: "
                                              r"rotary_interleaved$"):
        build_configs(parse_args(flags_of(model.config) + ["--load", bad], world_size=1))
