"""Megazero models loaded from random HF Qwen3 (QK-norm; with a sliding window on every layer,
and tied without one, as the small Qwen3), Qwen3-MoE (8 experts top-3, ``norm_topk_prob`` both
ways, a dense layer by ``mlp_only_layers``), Mistral and Qwen2.5 with a sliding window, and
Mixtral with one: transformers' logits (fp32, max |a - b| / max |b| <= 1e-5) and greedy tokens
(prompts longer than the window) at TP 1 and TP 2 (Qwen3-MoE also EP 2 and TP 2 x EP 2), exact
round trips, exported config.json rebuilding the same HF model; HF configs megazero cannot express
refused in one line naming the key. Skips without transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megazero.checkpoint.convert.hf import (arch_of, arch_of_config, config_from_hf, hf_config_of,  # noqa: E402
                                            load_hf, to_hf_state_dict)
from megazero.checkpoint.convert.hf_moe import unfuse_experts  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.model import GPTModel  # noqa: E402
from megazero.model.config import replace_config  # noqa: E402
from megazero.parallel.topology import Topology  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402
from tests.checkpoint.test_hf_moe_mapping import EOD, VOCAB, _hf_tokens, _random  # noqa: E402

BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=32, initializer_range=0.3, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
WINDOW = dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)


def qwen3(**kw):
    torch.manual_seed(0)
    return _random(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**BASE, **kw})))


def qwen3_moe(**kw):
    torch.manual_seed(0)
    cfg = dict(BASE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, mlp_only_layers=[1],
               norm_topk_prob=True)
    return _random(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**cfg, **kw})))


def mistral(**kw):
    torch.manual_seed(0)
    return _random(transformers.MistralForCausalLM(transformers.MistralConfig(**{**BASE, "sliding_window": 4, **kw})))


def qwen2(**kw):
    torch.manual_seed(0)
    return _random(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**BASE, **WINDOW, **kw})))


def mixtral(**kw):
    torch.manual_seed(0)
    cfg = dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    return _random(transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**cfg, **kw})))


def _case(model):
    ids = torch.randint(0, VOCAB - 1, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model.config.to_dict(), state, ids, logits, _hf_tokens(model, ids[:, :9])


def _check(rank, world, cases, layouts):
    errors = {}
    for tp, ep in layouts:
        topo = Topology(world, rank, tp=tp, ep=ep).create_groups()
        for name, (hf_config, state, ids, ref, tokens) in cases.items():
            key = f"{name} tp{tp} ep{ep}"
            config = config_from_hf(hf_config, make_vocab_size_divisible_by=8)
            model = GPTModel(config, topo).eval()
            assert load_hf(model, state) == []
            with torch.no_grad():
                errors[f"{key} logits"] = ((gather_from_tp_region(model(ids), topo.tp_group)[..., :VOCAB] - ref).abs()
                                           .max() / ref.abs().max()).item()
            hub, back = unfuse_experts(state, hf_config["model_type"]), to_hf_state_dict(model)
            errors[f"{key} roundtrip"] = float(set(back) != set(hub) or any(not torch.equal(back[k], hub[k])
                                                                            for k in hub))
            got = generate(model, ids[:, :9].tolist(), 8, eod=EOD, group=torch.distributed.group.WORLD).tokens
            errors[f"{key} generate"] = float(got != tokens)
    return errors


def _assert_all(results):
    for errors in results:
        bad = {k: v for k, v in errors.items() if v > (1e-5 if k.endswith("logits") else 0.0)}
        assert not bad, bad


def test_dense_families_at_tp_1_and_2():
    cases = {"qwen3 window": _case(qwen3(**WINDOW)), "qwen3 tied": _case(qwen3(tie_word_embeddings=True)),
             "mistral": _case(mistral()), "qwen2.5 window tied": _case(qwen2(tie_word_embeddings=True, qkv_bias=True))}
    _assert_all(run_distributed(_check, 2, cases, [(1, 1), (2, 1)], timeout_s=300))


def test_qwen3_moe_and_mixtral_window_at_tp_and_ep():
    cases = {"qwen3_moe": _case(qwen3_moe()), "qwen3_moe pre-softmax window": _case(qwen3_moe(
        norm_topk_prob=False, use_sliding_window=True, sliding_window=5)), "mixtral window": _case(mixtral())}
    _assert_all(run_distributed(_check, 4, cases, [(1, 1), (2, 1), (1, 2), (2, 2)], timeout_s=300))


@pytest.mark.parametrize("make,arch,window,qk", [(lambda: qwen3(**WINDOW), "qwen3", (4, 0), True),
                                                 (qwen3_moe, "qwen3_moe", None, True),
                                                 (mistral, "mistral", (3, 0), False),
                                                 (qwen2, "qwen2", (4, 0), False), (mixtral, "mixtral", (5, 0), False)])
def test_fields_arch_and_exported_config_rebuilds_the_model(make, arch, window, qk):
    hf = make()
    config = config_from_hf(hf.config.to_dict())
    assert (config.window_size, config.qk_layernorm, arch_of_config(config)) == (window, qk, arch)
    assert arch_of(hf.config.to_dict()) == arch
    assert arch not in ("qwen3", "qwen3_moe") or arch_of(hf.state_dict()) == arch  # told by q_norm
    again = type(hf)(type(hf.config)(**hf_config_of(config, arch))).eval()
    again.load_state_dict(hf.state_dict())
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("cfg,key", [
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1), "max_window_layers=1"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4,
          layer_types=["sliding_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias"),
    (dict(model_type="qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "yarn"),
    (dict(model_type="qwen3_moe", num_experts=0), "num_experts=0"),
    (dict(model_type="qwen2_moe", num_experts=4, shared_expert_intermediate_size=8, use_sliding_window=True),
     "use_sliding_window"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window=0")])
def test_refuses_what_megazero_cannot_express(cfg, key):
    full = dict(BASE, num_experts_per_tok=2, moe_intermediate_size=8, **cfg)
    with pytest.raises(ValueError, match=key):
        config_from_hf(full)


def test_export_refuses_what_the_architecture_cannot_hold():
    q3 = config_from_hf(qwen3(**WINDOW).config.to_dict())
    for arch, why in (("llama", "--qk-layernorm"), ("mistral", "--qk-layernorm"), ("qwen2", "--qk-layernorm")):
        with pytest.raises(ValueError, match=why):
            hf_config_of(q3, arch)
    plain = replace_config(q3, qk_layernorm=False)
    with pytest.raises(ValueError, match="Llama export needs: no --window-size"):
        hf_config_of(plain, "llama")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM export needs: no biases"):
        hf_config_of(replace_config(q3, add_qkv_bias=True), "qwen3")
    moe = config_from_hf(qwen3_moe().config.to_dict())
    with pytest.raises(ValueError, match="no shared expert"):
        hf_config_of(replace_config(moe, moe=replace_config(moe.moe, shared_expert_intermediate_size=16)), "qwen3_moe")
    with pytest.raises(ValueError, match="--window-size"):
        hf_config_of(replace_config(moe, window_size=(3, 0)), "qwen2_moe")
    mla = replace_config(q3, window_size=None, num_query_groups=4, multi_latent_attention=True, kv_lora_rank=16,
                         qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM export needs: standard attention"):
        hf_config_of(mla, "qwen3")


def test_qwen3_30b_a3b_config_maps_to_128_experts_top_8_and_the_planner_counts_it():
    """Qwen3-30B-A3B's config.json (its model card: 30.5B parameters, 3.3B activated; the planner
    counts 30.53B and 3.35B): 128 experts, top-8 renormalized (norm_topk_prob), no shared expert,
    every layer MoE, QK-norm."""
    from megazero.planner import memory
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
           "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
           "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
           "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
           "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
           "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
           "use_sliding_window": False, "vocab_size": 151936}
    c = config_from_hf(cfg, make_vocab_size_divisible_by=1)
    assert (c.moe.num_experts, c.moe.router_topk, c.moe.pre_softmax, c.moe.shared_expert_intermediate_size) == (
        128, 8, False, None)
    assert c.qk_layernorm and c.window_size is None and all(c.moe.layer_pattern) and c.kv_channels == 128
    assert round(memory.total_params(c) / 1e9, 1) == 30.5 and round(memory.active_params(c) / 1e9, 2) == 3.35
    assert hf_config_of(c, "qwen3_moe")["num_experts"] == 128
