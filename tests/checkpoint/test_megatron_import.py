"""tools/convert_checkpoint.py from-megatron: Megatron-LM legacy checkpoints (written as
Megatron-LM core_v0.13.0 writes them, tests/checkpoint/megatron_format.py) at TP 2 x PP 2 (and VP,
release, both key families, and --add-qkv-bias without other biases) give a megazero checkpoint whose model has the directly built
model's logits, and that --load reshards into a 3D training layout."""
import enum
import sys
import types

import numpy as np
import pytest
import torch

from megazero.checkpoint.convert.megatron import MegatronCheckpoint, megazero_name
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.schema import CheckpointError
from megazero.model import GPTConfig, GPTModel
from tests.checkpoint.megatron_format import write_megatron_checkpoint
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_reshard import run
from tests.test_training import TINY, layout_flags

GPT2ISH = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
               max_position_embeddings=16, activation="gelu_tanh", attention_dropout=0.0, hidden_dropout=0.0)
LLAMAISH = dict(GPT2ISH, activation="swiglu", position_embedding_type="rope", normalization="RMSNorm",
                add_bias_linear=False, untie_embeddings_and_output_weights=True, num_query_groups=2,
                ffn_hidden_size=48)
QWEN2ISH = dict(LLAMAISH, add_qkv_bias=True)  # --disable-bias-linear --add-qkv-bias: a bias on QKV alone


def direct_model(kw, seed=3):
    torch.manual_seed(seed)
    model = GPTModel(GPTConfig(**kw), None).eval()
    with torch.no_grad():  # every tensor random (norms and biases too), so a wrong mapping shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids)[..., :model.config.vocab_size]


def converted_model(root):
    reader = CheckpointReader(root)
    model = GPTModel(GPTConfig.from_saved_args(reader.args, attention_dropout=0.0, hidden_dropout=0.0), None).eval()
    assert model.load_full_state_dict(reader.full_model_state_dict(), strict=False) == []
    return model, reader


@pytest.mark.parametrize("kw,family,tp,pp,vp,iteration", [
    (GPT2ISH, "legacy", 2, 2, None, 20), (LLAMAISH, "legacy", 2, 2, None, None),
    (LLAMAISH, "mcore", 2, 2, None, 7), (GPT2ISH, "te", 2, 2, None, 7), (LLAMAISH, "te", 2, 1, 2, 5),
    (QWEN2ISH, "mcore", 2, 2, None, 3), (QWEN2ISH, "legacy", 2, 1, None, 3),
])
def test_from_megatron_logits(tmp_path, kw, family, tp, pp, vp, iteration):
    model = direct_model(kw)
    full = model.full_state_dict()
    src = write_megatron_checkpoint(str(tmp_path / "mt"), full, model.config, tp, pp, vp, family, iteration,
                                    tokenizer_type="NullTokenizer", vocab_size=99)
    conv = tool()
    assert conv.main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz")]) == 0
    ours, reader = converted_model(str(tmp_path / "mz"))
    assert reader.iteration == (iteration or 0) and reader.args["tokenizer_type"] == "NullTokenizer"
    assert reader.args["vocab_size"] == 100  # Megatron's NullTokenizer: --vocab-size 99 -> 100 ids
    assert reader.args["add_qkv_bias"] is model.config.qkv_bias  # as Megatron records it
    for name, t in full.items():
        assert torch.equal(reader.full_param(name), t), name
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(model, ids), rtol=0, atol=0)


def test_megatron_import_trains_in_3d_layout(tmp_path):
    """The converted checkpoint --load's into TP 2 x PP 2 (ZeRO 1) and trains."""
    model = direct_model(LLAMAISH)
    src = write_megatron_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, 2, 2,
                                    family="mcore", iteration=20)
    conv = tool()
    config, _, _ = conv.from_megatron(src, str(tmp_path / "mz"), vocab_size=100)
    flags = (TINY + ["--mock-data", "--train-iters", "23", "--load", str(tmp_path / "mz")]
             + conv.pretrain_flags(config).split() + layout_flags(2, 2, None, 1))
    hist = run(4, flags, save_at_load=str(tmp_path / "3d"))
    assert [i for i, _ in hist] == [21, 22, 23] and all(np.isfinite(l) for _, l in hist)
    reader = CheckpointReader(str(tmp_path / "3d"))
    assert reader.layout["pipeline_model_parallel_size"] == 2
    for name, t in model.full_state_dict().items():
        assert torch.equal(reader.full_param(name), t), name


def test_megatron_args_with_megatron_classes_load(tmp_path, monkeypatch):
    """args holding Megatron enums (e.g. attention_backend) load without Megatron installed."""
    mod = types.ModuleType("megatron.core.transformer.enums")
    AttnBackend = enum.Enum("AttnBackend", {"flash": 1, "auto": 5})
    AttnBackend.__module__ = mod.__name__
    mod.AttnBackend = AttnBackend
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    model = direct_model(GPT2ISH)
    src = write_megatron_checkpoint(str(tmp_path / "mt"), model.full_state_dict(), model.config, 1, 1,
                                    attention_backend=AttnBackend.auto)
    for name in ("megatron", "megatron.core", "megatron.core.transformer", mod.__name__):
        monkeypatch.delitem(sys.modules, name)  # loading must not need Megatron-LM
    with MegatronCheckpoint(src, vocab_size=100) as ckpt:
        assert ckpt.config.activation == "gelu_tanh" and (ckpt.tp, ckpt.pp, ckpt.iteration) == (1, 1, 20)


def test_megatron_errors(tmp_path):
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration"):
        MegatronCheckpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(CheckpointError, match="release is missing"):
        MegatronCheckpoint(str(tmp_path))
    (tmp_path / "release" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable"):
        MegatronCheckpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="unknown Megatron-LM parameter"):
        megazero_name("decoder.layers.0.mlp.linear_fc3.weight")
    assert megazero_name("decoder.layers.3.mlp.linear_fc1.layer_norm_bias") == ("layers.3.post_attention_norm.bias", 3)
