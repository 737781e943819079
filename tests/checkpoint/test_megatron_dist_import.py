"""Megatron-LM ``torch_dist`` checkpoints (tests/checkpoint/megatron_dist_format.py, written with
``torch.distributed.checkpoint`` as megatron-core 0.16.1 writes them) import with
``from-megatron``: the model's tensors and logits exactly; megazero's own-format tools name the
command; bad folders are refused in one line naming the file, nothing written."""
import os

import pytest
import torch

import megazero

from megazero.checkpoint import files
from megazero.checkpoint.schema import CheckpointError
from megazero.model.config import SHAPE_KEYS
from tests.checkpoint.megatron_dist_format import write_torch_dist_checkpoint
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_megatron_import import GPT2ISH, LLAMAISH, QWEN2ISH, converted_model, direct_model, logits_of


def snapshot(root):
    return sorted((d, f, os.path.getmtime(os.path.join(d, f))) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("kw,optimizer", [(GPT2ISH, False), (LLAMAISH, True), (QWEN2ISH, False)])
def test_from_megatron_torch_dist_logits(tmp_path, kw, optimizer):
    model = direct_model(kw)
    full = model.full_state_dict()
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), full, model.config, iteration=7, optimizer=optimizer)
    before = snapshot(src)
    assert tool().main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz")]) == 0
    assert snapshot(src) == before  # nothing written into the source folder
    ours, reader = converted_model(str(tmp_path / "mz"))
    assert reader.iteration == 7 and reader.args["vocab_size"] == 100
    for name, t in full.items():
        assert torch.equal(reader.full_param(name), t), name
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(model, ids), rtol=0, atol=0)
    with torch.no_grad():  # megazero.load_model: real vocabulary logits
        torch.testing.assert_close(megazero.load_model(str(tmp_path / "mz"))(ids), logits_of(model, ids),
                                   rtol=0, atol=0)
    # --use-checkpoint-args on the import: the model flags are Megatron's saved args
    from megazero.arguments import parse_args
    args = parse_args(["--load", str(tmp_path / "mz"), "--use-checkpoint-args", "--micro-batch-size", "1",
                       "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                       "--vocab-size", "100"], world_size=1)
    from megazero.config.model import gpt_config
    got, want = gpt_config(args).to_args(1), model.config.to_args(1)
    assert {k: got.get(k) for k in SHAPE_KEYS} == {k: want.get(k) for k in SHAPE_KEYS}
    assert got["swiglu"] == want["swiglu"] and got["position_embedding_type"] == want["position_embedding_type"]


def test_megazero_tools_on_a_torch_dist_folder_name_the_command(tmp_path):
    """megazero's own-format readers (to-fp32, to-hf, load_model) say what it is: pretrain_gpt.py
    --load reads it (tests/checkpoint/test_megatron_dist_load.py), these tools after from-megatron."""
    model = direct_model(LLAMAISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config)
    with pytest.raises(CheckpointError, match="pretrain_gpt.py --load .*mt reads it as it is.*from-megatron "
                                              "--load .*mt --save NEW_DIR") as e:
        files.read_metadata(src, 7)
    assert "\n" not in str(e.value)
    from megazero.config.checkpoint_args import latest_args
    saved, why = latest_args(src)  # no reader of Megatron's common.pt given: who reads it
    assert saved is None and "pretrain_gpt.py reads" in why and "\n" not in why


def refused(tmp_path, src, capsys):
    before = snapshot(src)
    assert tool().main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz")]) == 1
    err = capsys.readouterr().err.strip()
    assert snapshot(src) == before
    assert not os.path.exists(tmp_path / "mz") or not os.listdir(tmp_path / "mz")
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_shard_is_refused(tmp_path, capsys):
    model = direct_model(GPT2ISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config)
    os.remove(os.path.join(src, "iter_0000007", "__0_0.distcp"))
    err = refused(tmp_path, src, capsys)
    assert "__0_0.distcp is missing" in err


def test_unknown_arch_is_refused(tmp_path, capsys):
    model = direct_model(GPT2ISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config,
                                      squared_relu=True)
    err = refused(tmp_path, src, capsys)
    assert "iter_0000007/common.pt: unsupported Megatron-LM model options: squared_relu" in err



def test_truncated_shard_is_refused(tmp_path, capsys):
    model = direct_model(GPT2ISH)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config)
    path = os.path.join(src, "iter_0000007", "__0_0.distcp")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    err = refused(tmp_path, src, capsys)
    assert "iter_0000007: cannot read" in err


@pytest.mark.parametrize("freq", ["[1,0,1,1]", "1"])
def test_from_megatron_torch_dist_moe(tmp_path, freq):
    """Routed experts ``[L, E, ...]`` (every layer MoE) or per layer ``decoder.layers.N.*`` (a
    dense layer among them), router with expert bias, gated shared expert."""
    from tests.checkpoint.test_megatron_moe_import import import_model, moe_model
    model, full = moe_model(moe_layer_freq=freq)
    src = write_torch_dist_checkpoint(str(tmp_path / "mt"), full, model.config)
    assert tool().main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz")]) == 0
    ours, reader = import_model(str(tmp_path / "mz"))
    for name, t in full.items():
        assert torch.equal(reader.full_param(name), t), name
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(model, ids), rtol=0, atol=0)


def test_unknown_key_is_refused_by_name(tmp_path, capsys):
    """A weight megazero has no place for (here an attention output gate's) is named with the folder."""
    import torch.distributed.checkpoint as dcp
    model = direct_model(LLAMAISH)
    src2 = str(tmp_path / "mt2")
    write_torch_dist_checkpoint(src2, model.full_state_dict(), model.config)
    folder = os.path.join(src2, "iter_0000007")
    meta = dcp.FileSystemReader(folder).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    state["decoder.layers.self_attention.linear_gate.weight"] = torch.ones(4, 8)
    for name in os.listdir(folder):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(os.path.join(folder, name))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    err = refused(tmp_path, src2, capsys)
    assert "iter_0000007: unknown Megatron-LM parameter 'decoder.layers.0.self_attention.linear_gate.weight'" in err
