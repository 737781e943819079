"""--add-qkv-bias (Megatron-LM core_v0.16.0: ``TransformerConfig.add_qkv_bias``; ``linear_qkv`` built
with ``bias=add_bias_linear or add_qkv_bias``; ``validate_args`` sets it under ``add_bias_linear``):
a bias on the QKV projection alone, split over TP like the QKV rows, recorded in the checkpoint and
compared on load, counted by the planner."""

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config.megatron_flags import megatron_flags
from megazero.config.model import gpt_config
from megazero.model import GPTConfig, GPTModel
from megazero.model.saved_args import checkpoint_model_args, model_arg_diffs
from megazero.parallel.topology import Topology
from megazero.planner import memory
from megazero.testing import run_distributed

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "100", "--attention-dropout", "0", "--hidden-dropout", "0"]
QWEN2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
             seq_length=16, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0, hidden_dropout=0.0)


def test_the_flag_is_honoured_and_only_the_qkv_has_a_bias():
    row = next(f for f in megatron_flags() if f.name == "--add-qkv-bias")
    assert row.cls == 1 and row.dest == "add_qkv_bias"
    cfg = gpt_config(parse_args(ARGV + ["--disable-bias-linear", "--add-qkv-bias"], world_size=1))
    assert (cfg.add_bias_linear, cfg.add_qkv_bias, cfg.qkv_bias) == (False, True, True)
    biases = sorted(n for n, _ in GPTModel(cfg).named_parameters() if n.endswith(".bias") and "norm" not in n)
    assert biases == ["layers.0.attention.qkv.bias", "layers.1.attention.qkv.bias"]
    assert GPTConfig.from_saved_args(cfg.to_args()).qkv_bias
    plain = gpt_config(parse_args(ARGV + ["--disable-bias-linear"], world_size=1))
    assert not plain.qkv_bias and not any(n.endswith(".bias") and "norm" not in n
                                          for n, _ in GPTModel(plain).named_parameters())


def test_recorded_as_megatron_records_it_and_compared_on_load():
    """Biases on every linear imply the QKV's: recorded True, so a Megatron checkpoint (where
    validate_args set it) and a megazero one of the same model agree."""
    biased = gpt_config(parse_args(ARGV, world_size=1))
    assert biased.to_args()["add_qkv_bias"] is True and biased.qkv_bias and not biased.add_qkv_bias
    explicit = gpt_config(parse_args(ARGV + ["--add-qkv-bias"], world_size=1))
    assert model_arg_diffs(biased.to_args(), explicit.to_args()) == []
    qkv_only = GPTConfig(**QWEN2).to_args()
    none = dict(qkv_only, add_qkv_bias=False)
    assert model_arg_diffs(qkv_only, none) == ["--add-qkv-bias: command line False, checkpoint True"]
    # where --disable-bias-linear differs, its line alone (the QKV bias follows from it)
    assert model_arg_diffs(none, dict(none, add_bias_linear=True, add_qkv_bias=True)) == [
        "--disable-bias-linear (add_bias_linear): command line True, checkpoint False"]
    assert checkpoint_model_args(qkv_only, {"add_qkv_bias": False, "add_bias_linear": True}) == {
        "add_qkv_bias": True, "add_bias_linear": False}


def test_megatron_without_biases_is_unchanged():
    """A checkpoint of a model without biases recorded before the flag existed loads as before."""
    old = {k: v for k, v in GPTConfig(**dict(QWEN2, add_qkv_bias=False)).to_args().items() if k != "add_qkv_bias"}
    assert model_arg_diffs(old, GPTConfig(**dict(QWEN2, add_qkv_bias=False)).to_args()) == []
    assert not GPTConfig.from_saved_args(old).qkv_bias


def test_planner_counts_the_qkv_bias():
    cfg = GPTConfig(**QWEN2)
    no_bias = GPTConfig(**dict(QWEN2, add_qkv_bias=False))
    qkv_rows = (4 + 2 * 2) * 8
    for tp in (1, 2):
        assert memory.attention_params(cfg, tp) - memory.attention_params(no_bias, tp) == qkv_rows // tp
    assert memory.total_params(cfg) == sum(p.numel() for p in GPTModel(cfg).parameters())


def _tp_shards(rank, world, full):
    topo = Topology(world, rank, tp=world).create_groups()
    model = GPTModel(GPTConfig(**QWEN2), topo).eval()
    assert model.load_full_state_dict(full) == []
    ids = torch.arange(12).reshape(2, 6)
    from megazero.tensor_parallel import gather_from_tp_region
    with torch.no_grad():
        logits = gather_from_tp_region(model(ids), topo.tp_group)[..., :100]
    return model.layers["0"].attention.qkv.bias.detach().clone(), logits


@pytest.mark.parametrize("tp", [2])
def test_the_bias_is_split_over_tp_as_the_qkv_rows(tp):
    """TP rank t holds [Q_t; K_t; V_t] of the bias (Q's heads and K/V's groups each cut in TP
    blocks, as the weight's rows), and the TP model computes TP 1's logits."""
    torch.manual_seed(0)
    one = GPTModel(GPTConfig(**QWEN2)).eval()
    with torch.no_grad():
        for p in one.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    full = one.full_state_dict()
    with torch.no_grad():
        ref = one(torch.arange(12).reshape(2, 6))[..., :100]
    q, k, v = full["layers.0.attention.qkv.bias"].split([32, 16, 16])
    for t, (bias, logits) in enumerate(run_distributed(_tp_shards, tp, full)):
        want = torch.cat([x.chunk(tp)[t] for x in (q, k, v)])
        assert torch.equal(bias, want), t
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
