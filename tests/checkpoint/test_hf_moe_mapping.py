"""Megazero MoE models loaded from random HF Mixtral / Qwen2-MoE (``qkv_bias`` true, as every
released Qwen1.5-MoE / Qwen2-MoE: ``--add-qkv-bias``; and false) give transformers' logits and
greedy tokens at EP 1/2 x TP 1/2 (ETP = TP and ETP 1), and convert back unchanged.

fp32 logits: max |a - b| / max |b| <= 1e-5 (as the dense HF tests); round trips exact, both in
the Hub's per-expert names and in transformers 5's fused in-memory layout. Skips without transformers.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megazero.model import GPTModel  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.checkpoint.convert.hf import config_from_hf, hf_config_of, load_hf, to_hf_state_dict  # noqa: E402
from megazero.checkpoint.convert.hf_moe import unfuse_experts  # noqa: E402
from megazero.parallel.topology import Topology  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402

VOCAB, NEW, EOD = 100, 8, 99
# (TP, EP, ETP) on 4 ranks: the rest of the world is data parallel (replicas with the same prompts)
LAYOUTS = [(1, 1, None), (1, 2, None), (2, 1, None), (2, 2, 2), (2, 2, 1)]


def mixtral(**overrides):
    cfg = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=32, tie_word_embeddings=False, initializer_range=0.3, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(0)
    return _random(transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**cfg, **overrides})))


def qwen2_moe(**overrides):
    """Layer 1 dense (``mlp_only_layers``), the others MoE with the gated shared expert; biases on
    q/k/v (``qkv_bias``, transformers' default) and nowhere else."""
    cfg = dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=48,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_experts=4,
               num_experts_per_tok=2, mlp_only_layers=[1], qkv_bias=True, max_position_embeddings=32,
               initializer_range=0.3, norm_topk_prob=False)
    torch.manual_seed(0)
    return _random(transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**cfg, **overrides})))


def _random(model):
    """Every weight random (Qwen2-MoE's router starts at zero, norms at one), so a wrong mapping
    or routing shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _hf_tokens(model, ids):
    """transformers' greedy continuation of each row, cut after EOD."""
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=EOD, pad_token_id=0)
    rows = [r[ids.shape[1]:].tolist() for r in out]
    return [r[:r.index(EOD) + 1] if EOD in r else r for r in rows]


def _case(model):
    ids = torch.randint(0, VOCAB - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model.config.to_dict(), state, ids, logits, _hf_tokens(model, ids[:, :6])


def _check(rank, world, cases):
    """Per layout and model: logits, the gathered export (every expert, exact) and greedy tokens."""
    errors = {}
    for tp, ep, etp in LAYOUTS:
        topo = Topology(world, rank, tp=tp, ep=ep, etp=etp).create_groups()
        for name, (hf_config, state, ids, ref, tokens) in cases.items():
            key = f"{name} tp{tp} ep{ep} etp{etp or tp}"
            config = config_from_hf(hf_config, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                                    attention_dropout=0.0)
            model = GPTModel(config, topo).eval()
            assert load_hf(model, state) == []
            with torch.no_grad():
                logits = gather_from_tp_region(model(ids), topo.tp_group)[..., :VOCAB]
            errors[f"{key} logits"] = _max_rel(logits, ref)
            hub = unfuse_experts(state, hf_config["model_type"])
            back = to_hf_state_dict(model)
            errors[f"{key} keys"] = float(set(back) != set(hub))
            errors[f"{key} roundtrip"] = max((back[k] - hub[k]).abs().max().item() for k in hub if k in back)
            got = generate(model, ids[:, :6].tolist(), NEW, eod=EOD, group=torch.distributed.group.WORLD).tokens
            errors[f"{key} generate"] = float(got != tokens)
    return errors



def test_logits_roundtrip_and_generation_at_ep_and_tp():
    cases = {"mixtral": _case(mixtral()), "qwen2_moe": _case(qwen2_moe())}
    for tokens in (c[4] for c in cases.values()):
        assert any(len(set(row)) > 2 for row in tokens), "degenerate reference"
    for errors in run_distributed(_check, 4, cases, timeout_s=300):
        bad = {k: v for k, v in errors.items() if v > (1e-5 if k.endswith("logits") else 0.0)}
        assert not bad, bad


@pytest.mark.parametrize("make,kw", [(qwen2_moe, dict(norm_topk_prob=True, decoder_sparse_step=2,
                                                      mlp_only_layers=[])),
                                     (qwen2_moe, dict(qkv_bias=False)),
                                     (mixtral, dict(num_experts_per_tok=1, tie_word_embeddings=True))])
def test_routing_variants_one_process(make, kw):
    """Qwen2-MoE's renormalized top-k (default routing) with every second layer MoE; Qwen2-MoE
    without the QKV bias; Mixtral top-1, tied."""
    hf = make(**kw)
    hf_config, state, ids, ref, _ = _case(hf)
    config = config_from_hf(hf_config, make_vocab_size_divisible_by=8)
    model = GPTModel(config, None).eval()
    assert load_hf(model, state) == []
    assert config.moe.pre_softmax is (make is qwen2_moe and not kw.get("norm_topk_prob"))
    assert config.add_qkv_bias is (make is qwen2_moe and kw.get("qkv_bias", True)) and not config.add_bias_linear
    if make is qwen2_moe and "decoder_sparse_step" in kw:
        assert config.moe.layer_pattern == (0, 1, 0)
    with torch.no_grad():
        assert _max_rel(model(ids)[..., :VOCAB], ref) <= 1e-5
    fused = to_hf_state_dict(model, fused_experts=True)  # transformers 5's in-memory layout
    assert set(fused) == set(state) and all(torch.equal(fused[k], state[k]) for k in state)
    again = type(hf)(type(hf.config)(**hf_config_of(config, hf_config["model_type"])))  # the exported config.json
    again.load_state_dict(fused)
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, ref)


@pytest.mark.parametrize("arch,key,value", [("qwen2_moe", "use_sliding_window", True),
                                            ("qwen2_moe", "num_experts", 0),
                                            ("qwen2_moe", "shared_expert_intermediate_size", 0),
                                            ("qwen2_moe", "hidden_act", "gelu"),
                                            ("mixtral", "num_experts_per_tok", 9)])
def test_refuses_what_megazero_cannot_express(arch, key, value):
    make = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig}[arch]
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=32, qkv_bias=False)
    cfg = make(**{**base, key: value}).to_dict()
    cfg[key] = value  # as config.json would hold it
    with pytest.raises(ValueError, match=key):
        config_from_hf(cfg)


def test_export_refuses_what_hf_cannot_express():
    from megazero.model.config import replace_config
    config = config_from_hf(qwen2_moe().config)
    with pytest.raises(ValueError, match="every layer MoE.*no shared expert.*top-k renormalized"):
        hf_config_of(config, "mixtral")
    with pytest.raises(ValueError, match="a gated shared expert"):
        hf_config_of(replace_config(config, moe=replace_config(config.moe, shared_expert_gate=False)), "qwen2_moe")
    with pytest.raises(ValueError, match="does not export as 'llama'"):
        hf_config_of(config, "llama")
