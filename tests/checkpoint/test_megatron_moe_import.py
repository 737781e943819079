"""tools/convert_checkpoint.py from-megatron for Megatron-core MoE checkpoints (written as core
0.20.0 writes them, tests/checkpoint/megatron_format.py): expert-parallel rank folders
(``mp_rank_TT[_PPP]_EEE``), the router and its expert bias, routed experts in the sequential,
TE-grouped and legacy grouped layouts split over expert TP, shared experts with their gate.
Every full tensor and the logits equal the model built from the same weights, and the
converted checkpoint loads into an expert-parallel layout with the same full model."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megazero.checkpoint.convert.megatron import MegatronCheckpoint
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.schema import CheckpointError
from megazero.model import GPTConfig, GPTModel
from megazero.testing import run_distributed
from tests.checkpoint.megatron_format import write_megatron_checkpoint
from tests.checkpoint.test_convert_checkpoint import tool
from tests.checkpoint.test_moe_checkpoint import BIAS, OVERRIDES, Run, _topo
from tests.moe.helpers import VOCAB, moe_config


def moe_model(seed=3, **overrides):
    torch.manual_seed(seed)
    model = GPTModel(moe_config(**dict(OVERRIDES, **overrides)), None).eval()
    with torch.no_grad():  # every tensor random, the expert bias too, so a wrong mapping shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    full = dict(model.full_state_dict())
    full.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return model, full


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids)[..., :model.config.vocab_size]


def import_model(root: str):
    reader = CheckpointReader(root)
    config = GPTConfig.from_saved_args(reader.args, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(config, None).eval()
    assert model.load_full_state_dict(reader.full_model_state_dict(), strict=False) == []
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(reader.full_param(name))
    return model, reader


@pytest.mark.parametrize("family,tp,pp,ep,etp,experts,folder", [
    ("mcore", 2, 2, 2, None, "sequential", "mp_rank_01_001_001"),
    ("te", 2, 1, 2, 1, "grouped", "mp_rank_01_001"),      # one suffix, PP 1: the EP rank
    ("mcore", 2, 1, 2, None, "legacy", "mp_rank_00_001"),
    ("te", 1, 2, 1, None, "legacy", "mp_rank_00_001"),    # one suffix, PP 2: the PP rank
])
def test_moe_from_megatron_logits(tmp_path, family, tp, pp, ep, etp, experts, folder):
    model, full = moe_model()
    src = write_megatron_checkpoint(str(tmp_path / "mt"), full, model.config, tp, pp, family=family, iteration=9,
                                    ep=ep, etp=etp, experts=experts, tokenizer_type="NullTokenizer",
                                    vocab_size=VOCAB - 1)
    assert (tmp_path / "mt" / "iter_0000009" / folder / "model_optim_rng.pt").is_file()
    conv = tool()
    assert conv.main(["from-megatron", "--load", src, "--save", str(tmp_path / "mz")]) == 0
    ours, reader = import_model(str(tmp_path / "mz"))
    assert reader.version == 4 and reader.iteration == 9
    assert reader.args["num_experts"] == 4 and reader.args["moe_router_enable_expert_bias"]
    for name, t in full.items():
        assert torch.equal(reader.full_param(name), t), name
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(model, ids), rtol=0, atol=0)
    flags = conv.pretrain_flags(ours.config)
    assert "--num-experts 4" in flags and "--moe-layer-freq '[1,0,1,1]'" in flags
    assert "--moe-router-score-function sigmoid" in flags and "--moe-router-enable-expert-bias" in flags
    generate = _tool("generate")  # tools/generate.py reads the weights and the expert bias
    gen, _ = generate.load_model(str(tmp_path / "mz"), None, torch.device("cpu"))
    torch.testing.assert_close(logits_of(gen, ids), logits_of(model, ids), rtol=0, atol=0)


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_imported(rank, world, sizes, src):
    run = Run(_topo(rank, world, sizes), 1, sp=True)
    assert run.load(src) == "resharded"
    return run.full_state()


def test_imported_moe_loads_into_expert_parallel_layout(tmp_path):
    """EP 2 x TP 2 x expert TP 1 at ZeRO 1: the imported weights (TP 1, EP 1) on their EP ranks."""
    model, full = moe_model()
    src = write_megatron_checkpoint(str(tmp_path / "mt"), full, model.config, 2, 1, family="mcore", ep=2,
                                    experts="grouped")
    tool().from_megatron(src, str(tmp_path / "mz"), vocab_size=VOCAB)
    live = {}
    for r in run_distributed(_load_imported, 4, dict(tp=2, ep=2, etp=1), str(tmp_path / "mz"), timeout_s=300):
        live.update(r)
    for name in list(full) + BIAS:
        assert torch.equal(live[name], full[name]), name


def test_moe_megatron_errors(tmp_path):
    model, full = moe_model()
    src = write_megatron_checkpoint(str(tmp_path / "a"), full, model.config, 1, 1, family="mcore", ep=2,
                                    moe_mlp_glu_interleave_size=32)
    with pytest.raises(CheckpointError, match="moe_mlp_glu_interleave_size"):
        MegatronCheckpoint(src)
    src = write_megatron_checkpoint(str(tmp_path / "b"), full, model.config, 2, 1, family="mcore", ep=2)
    for t in (0, 1):  # EP rank 0's files gone: its experts are nowhere
        (tmp_path / "b" / "iter_0000020" / f"mp_rank_{t:02d}_000" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing rank files .* \[\(0, 0\)\]"):
        MegatronCheckpoint(src)
