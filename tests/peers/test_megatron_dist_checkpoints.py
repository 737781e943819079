"""Peer tests against megatron-core 0.16.1 itself: its GPTModel's ``sharded_state_dict`` saved by
``megatron.core.dist_checkpointing.save`` (``--ckpt-format torch_dist``, on CPU/gloo:
tests/peers/megatron_dist_helpers.py) at TP x PP (x VP); ``tools/convert_checkpoint.py
from-megatron`` imports the folder with ``torch.distributed.checkpoint`` and megazero's model
gives Megatron's logits; ``pretrain_gpt.py --load`` reads the folder as it is, into another layout."""
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron peer suite runs under `make peers`")

from megazero.testing import run_distributed  # noqa: E402
from tests.peers import megatron_dist_helpers as md  # noqa: E402
from tests.peers import megatron_helpers as mh  # noqa: E402

import megatron.core.models.gpt  # noqa: E402,F401  -- once in the parent; the forked ranks share it

CASES = [("gpt2", 1, 1, None), ("gpt2", 2, 1, None), ("llama", 2, 2, None), ("llama", 1, 2, 2)]
STYLES = {"gpt2": mh.GPT2, "llama": mh.LLAMA}


@pytest.mark.parametrize("style,tp,pp,vp", CASES)
def test_torch_dist_checkpoint_imports_with_megatrons_logits(tmp_path, style, tp, pp, vp):
    src = str(tmp_path / "mt")
    results = run_distributed(md.megatron_dist_rank, tp * pp, STYLES[style], tp, pp, vp, src, timeout_s=90)
    (ref,) = [r[..., :mh.VOCAB + 1] for r in results if r is not None]
    folder = os.path.join(src, "iter_0000007")
    names = sorted(os.listdir(folder))
    assert {".metadata", "common.pt", "metadata.json"} <= set(names) and any(n.endswith(".distcp") for n in names)
    before = {n: os.path.getmtime(os.path.join(folder, n)) for n in names}
    mh.convert(src, str(tmp_path / "mz"))
    assert {n: os.path.getmtime(os.path.join(folder, n)) for n in sorted(os.listdir(folder))} == before
    ours = mh.megazero_model(str(tmp_path / "mz")).eval()
    with torch.no_grad():
        got = ours(mh.batch(None)[0])[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_moe_torch_dist_checkpoint_imports_with_megatrons_logits(tmp_path, tp, ep):
    """megatron-core's MoE GPTModel (SequentialMLP, 4 experts, top-2) at TP x EP: the experts are
    saved stacked ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2f, h]``."""
    src = str(tmp_path / "mt")
    results = run_distributed(md.megatron_moe_dist_rank, tp * ep, tp, ep, src, timeout_s=90)
    ref = results[0][..., :mh.VOCAB + 1]
    mh.convert(src, str(tmp_path / "mz"))
    ours = mh.megazero_model(str(tmp_path / "mz")).eval()
    assert ours.config.moe.num_experts == 4
    with torch.no_grad():
        got = ours(mh.batch(None)[0])[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pretrain_loads_megatrons_torch_dist_directly(tmp_path):
    """``pretrain_gpt.py --load`` of megatron-core's own torch_dist folder (Llama-style, saved at
    TP 2), no conversion: loaded at PP 2 its weights give Megatron's logits (saved back right after
    the load and read in one process), and at TP 2 x DP 2 (ZeRO 1) it trains iterations 8-9 with
    the losses of the from-megatron conversion loaded at TP 1."""
    from megazero.checkpoint.convert.megatron_dist import MegatronDistCheckpoint
    from tests.checkpoint.test_megatron_dist_load import flags_of
    from tests.checkpoint.test_reshard import run
    from tests.test_training import layout_flags
    src = str(tmp_path / "mt")
    results = run_distributed(md.megatron_dist_rank, 2, mh.LLAMA, 2, 1, None, src, timeout_s=90)
    (ref,) = [r[..., :mh.VOCAB + 1] for r in results if r is not None]
    flags = flags_of(MegatronDistCheckpoint(src).config, iters=9) + ["--load", src]
    run(2, flags + layout_flags(1, 2, None, 0), save_at_load=str(tmp_path / "pp2"), train=False)
    with torch.no_grad():
        got = mh.megazero_model(str(tmp_path / "pp2")).eval()(mh.batch(None)[0])[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    hist = run(4, flags + layout_flags(2, 1, None, 1))
    mh.convert(src, str(tmp_path / "mz"))
    want = run(1, flags[:-2] + ["--load", str(tmp_path / "mz")])
    assert [i for i, _ in hist] == [8, 9] == [i for i, _ in want]
    torch.testing.assert_close([l for _, l in hist], [l for _, l in want], rtol=1e-5, atol=0)


def test_pretrain_loads_megatrons_moe_torch_dist_directly(tmp_path):
    """megatron-core's MoE GPTModel saved at TP 2 x EP 2 (experts stacked ``[L, E, ...]``),
    ``--load`` as it is at EP 2 x DP 2 (expert DP 1, ZeRO 1): its weights, saved back right after the
    load and read in one process, give Megatron's logits."""
    from megazero.checkpoint.convert.megatron_dist import MegatronDistCheckpoint
    from tests.checkpoint.test_megatron_dist_load import flags_of
    from tests.checkpoint.test_reshard import run
    from tests.test_training import layout_flags
    src = str(tmp_path / "mt")
    ref = run_distributed(md.megatron_moe_dist_rank, 4, 2, 2, src, timeout_s=90)[0][..., :mh.VOCAB + 1]
    flags = flags_of(MegatronDistCheckpoint(src).config, iters=8) + ["--load", src]
    run(4, flags + layout_flags(1, 1, None, 1) + ["--expert-model-parallel-size", "2"],
        save_at_load=str(tmp_path / "ep2"), train=False)
    ours = mh.megazero_model(str(tmp_path / "ep2")).eval()
    assert ours.config.moe.num_experts == 4
    with torch.no_grad():
        got = ours(mh.batch(None)[0])[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
