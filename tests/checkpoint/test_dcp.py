"""``--ckpt-format torch_dcp`` (issue 45 item 2): the trainer writes a PyTorch DCP folder that
``dcp_to_torch_save`` turns into megazero's fp32 export under ``transformers``' names (plus the
Adam moments), that loads back at another layout with the uninterrupted run's losses, and that
survives a round trip through PyTorch's own tools; a missing shard is one line naming the file."""

import shutil

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from megazero.checkpoint import schema
from megazero.checkpoint.convert.hf import arch_of_config, full_to_hf
from megazero.checkpoint.dcp import check_dcp_files
from megazero.checkpoint.reader import CheckpointReader
from megazero.model import GPTConfig
from tests.checkpoint.test_convert_checkpoint import LLAMA, tool
from tests.checkpoint.test_reshard import BASE, layout_flags, run, train_reference
from tests.model.test_mla_checkpoint import MLA_FLAGS



def expected_state(tmp_path, src) -> dict:
    """megazero's fp32 export (``to-fp32``) and its moments, under the HF names."""
    reader = CheckpointReader(str(src), 3)
    config = GPTConfig.from_saved_args(reader.args)
    arch = arch_of_config(config)
    export = dict(tool().to_fp32(str(src), str(tmp_path / "fp32.pt"), 3))
    out = full_to_hf(export, config, arch)
    if config.tied_embeddings:
        out.pop("lm_head.weight")
    for kind in ("exp_avg", "exp_avg_sq"):
        moments = full_to_hf({n: reader.full_param(n, kind) for n in reader.param_names()}, config, arch)
        out.update({f"optimizer.state.{k}.{kind}": v for k, v in moments.items() if k in out})
    return out


# (TP, PP, ZeRO) saved at DP 2, loaded back, loaded after PyTorch's round trip
LAYOUTS = {"gpt2": ((2, 1, 1), (1, 2, 0), (2, 1, 1)), "llama": ((1, 2, 3), (2, 1, 1), (1, 1, 0)),
           "qwen3": ((2, 1, 2), (1, 2, 1), (1, 1, 0))}
QWEN3 = LLAMA + ["--qk-layernorm", "--window-size", "5,0"]  # Qwen3ForCausalLM's names (q_norm, k_norm)


@pytest.mark.parametrize("style,extra", [("gpt2", []), ("llama", LLAMA), ("qwen3", QWEN3)])
def test_dcp_out_and_in(tmp_path, style, extra):
    """GPT-2 saved at TP 2 x DP 2 ZeRO 1, Llama (GQA, SwiGLU, untied) at PP 2 x DP 2 ZeRO 3."""
    flags = BASE + extra
    (tp, pp, z), back, again_layout = LAYOUTS[style]
    save = flags + layout_flags(tp, pp, None, z)
    src, ref = train_reference(tmp_path, "A", 4, save)
    dcp_root = tmp_path / "B"
    hist = run(4, save + ["--ckpt-format", "torch_dcp", "--save", str(dcp_root), "--save-interval", "3"])
    np.testing.assert_allclose([l for _, l in hist], ref, rtol=1e-6)
    (dcp_root / schema.LATEST).write_text("3\n")
    folder = dcp_root / "iter_0000003"
    sizes = [f.stat().st_size for f in folder.glob("*.distcp")]
    assert not list(folder.glob("rank_*.pt")) and len(sizes) == 4
    assert max(sizes) < 0.4 * sum(sizes), sizes  # each rank wrote about its own quarter, nothing gathered

    dcp_to_torch_save(str(folder), str(tmp_path / "dcp.pt"))
    got, want = torch.load(tmp_path / "dcp.pt", weights_only=True), expected_state(tmp_path, src)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert ("model.layers.0.self_attn.k_proj.weight" in got) == (style != "gpt2")
    assert ("model.layers.0.self_attn.q_norm.weight" in got) == (style == "qwen3")

    # back in at another layout: iterations 4-6 as the uninterrupted run
    hist = run(back[0] * back[1], flags + layout_flags(back[0], back[1], None, back[2]) + ["--load", str(dcp_root)])
    assert [it for it, _ in hist] == [4, 5, 6]
    np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5)

    # PyTorch's own round trip: the consolidated file back to DCP (one chunk per tensor), loaded
    again = tmp_path / "C"
    torch_save_to_dcp(str(tmp_path / "dcp.pt"), str(again / "iter_0000003"))
    shutil.copy(folder / "metadata.json", again / "iter_0000003" / "metadata.json")
    (again / schema.LATEST).write_text("3\n")
    tp, pp, z = again_layout
    hist = run(2, flags + layout_flags(tp, pp, None, z) + ["--load", str(again)])
    np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5)


def test_dcp_missing_shard_is_one_line(tmp_path):
    root = tmp_path / "B"
    run(2, BASE + ["--train-iters", "3", "--ckpt-format", "torch_dcp", "--save", str(root), "--save-interval", "3"]
        + layout_flags(2, 1, None, 0))
    folder = root / "iter_0000003"
    check_dcp_files(str(folder))
    with pytest.raises(schema.CheckpointError, match="is a PyTorch DCP checkpoint .*dcp_to_torch_save$"):
        CheckpointReader(str(root))  # megazero's own reader (to-fp32, load_model) says what it is
    before = sorted(p.name for p in folder.iterdir())
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(schema.CheckpointError, match=r"__1_0\.distcp is missing: the DCP checkpoint lacks a shard"):
        check_dcp_files(str(folder))
    with pytest.raises(Exception, match=r"__1_0\.distcp is missing"):
        run(1, BASE + ["--load", str(root)], train=False)
    assert sorted(p.name for p in folder.iterdir()) == [n for n in before if n != "__1_0.distcp"]
    size = (folder / "__0_0.distcp").stat().st_size
    (folder / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(schema.CheckpointError, match=r"__0_0\.distcp is truncated"):
        check_dcp_files(str(folder))
    (folder / "__0_0.distcp").write_bytes(b"\0" * size)  # the right length, not DCP's bytes
    (folder / "__1_0.distcp").write_bytes(b"\0" * size * 2)
    with pytest.raises(Exception, match=r"__\d_0\.distcp: cannot read .*: DCP rank 0: \w+"):
        run(1, BASE + ["--load", str(root)], train=False)


def test_dcp_flag_checks(capsys):
    from megazero.arguments import parse_args
    assert parse_args(BASE + ["--ckpt-format", "torch_dcp"], world_size=1).ckpt_format == "torch_dcp"
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--ckpt-format", "torch_dcp", "--async-save", "--save", "x"], world_size=1)
    assert "--ckpt-format torch_dcp with --async-save is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no transformers naming for a dense MLA model here
        parse_args(BASE + ["--ckpt-format", "torch_dcp"] + MLA_FLAGS, world_size=1)
    assert "--ckpt-format torch_dcp with --multi-latent-attention is not available" in capsys.readouterr().err


def test_dcp_bf16_virtual_stages(tmp_path):
    """bf16, PP 2 x VP 2 x DP 2, ZeRO 2: the fp32 masters out; loaded at TP 2 it trains as the
    same checkpoint in megazero's format loaded there (both resharded: weights = bf16(master))."""
    save = BASE + ["--bf16"] + layout_flags(1, 2, 2, 2)
    src, _ = train_reference(tmp_path, "A", 4, save)
    dcp_root = tmp_path / "B"
    run(4, save + ["--ckpt-format", "torch_dcp", "--save", str(dcp_root), "--save-interval", "3"])
    (dcp_root / schema.LATEST).write_text("3\n")
    dcp_to_torch_save(str(dcp_root / "iter_0000003"), str(tmp_path / "dcp.pt"))
    got, want = torch.load(tmp_path / "dcp.pt", weights_only=True), expected_state(tmp_path, src)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    back = BASE + ["--bf16"] + layout_flags(2, 1, None, 1)
    ours, theirs = run(2, back + ["--load", str(dcp_root)]), run(2, back + ["--load", str(src)])
    assert [it for it, _ in ours] == [4, 5, 6] and ours == theirs
