"""megazero DeepSeek-V3 models (MLA + sigmoid group-limited MoE + MTP) from random HF
``DeepseekV3ForCausalLM`` weights: transformers' logits (fp32, 1e-5) and greedy tokens at TP 1,
EP 2 and TP 2, the MTP layer's logits = transformers' ``MtpModel``'s, exact round trips (MTP weights
included, in DeepSeek's ``model.layers.{L+k}`` layout), and the refused config fields."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megazero.checkpoint.convert.hf import config_from_hf, hf_config_of, load_hf, to_hf_state_dict  # noqa: E402
from megazero.checkpoint.convert.hf_moe import unfuse_experts  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.model import GPTModel  # noqa: E402
from megazero.model.mtp import roll_left  # noqa: E402
from megazero.parallel.topology import Topology  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402

VOCAB, NEW, EOD, L = 96, 8, 95, 3
CFG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=L,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
           n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=64,
           rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                            "beta_slow": 1.0},
           initializer_range=0.3, tie_word_embeddings=False, num_nextn_predict_layers=1, bos_token_id=0,
           eos_token_id=EOD, pad_token_id=None)


def hf_model(**overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**CFG, **overrides}))
    with torch.no_grad():  # every weight random: norms, router and correction bias included
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _mtp_state(hf, seed=1):
    """Random MTP-layer weights in DeepSeek's layout (``model.layers.L.*``: a decoder layer's names
    plus enorm / hnorm / eh_proj / shared_head.norm), as transformers' MtpModel reads them."""
    g = torch.Generator().manual_seed(seed)
    layer = {k: v for k, v in hf.state_dict().items() if k.startswith(f"model.layers.{L - 1}.")}
    out = {k.replace(f"layers.{L - 1}.", f"layers.{L}."): v + 0.3 * torch.randn(v.shape, generator=g)
           for k, v in unfuse_experts(layer, "deepseek_v3").items()}
    h = CFG["hidden_size"]
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("shared_head.norm", (h,)), ("eh_proj", (h, 2 * h))):
        out[f"model.layers.{L}.{name}.weight"] = 1.0 + 0.3 * torch.randn(shape, generator=g)
    return out


def _case(hf):
    ids = torch.randint(0, VOCAB - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(ids).logits
    out = hf.generate(ids[:, :6], max_new_tokens=NEW, do_sample=False, eos_token_id=EOD, pad_token_id=0)
    tokens = [r[6:].tolist() for r in out]
    tokens = [r[:r.index(EOD) + 1] if EOD in r else r for r in tokens]
    state = dict(hf.state_dict(), **_mtp_state(hf))
    return hf.config.to_dict(), state, ids, logits, tokens


def _check(rank, world, case):
    hf_config, state, ids, ref, tokens = case
    errors = {}
    for tp, ep in ((1, 1), (1, 2), (2, 1)):
        topo = Topology(world, rank, tp=tp, ep=ep).create_groups()
        model = GPTModel(config_from_hf(hf_config, make_vocab_size_divisible_by=8), topo).eval()
        assert load_hf(model, state) == []
        ep = f"{ep} tp{tp}"
        with torch.no_grad():
            errors[f"ep{ep} logits"] = _rel(gather_from_tp_region(model(ids), topo.tp_group)[..., :VOCAB], ref)
        back, hub = to_hf_state_dict(model), unfuse_experts(state, "deepseek_v3")  # every expert, MTP's too
        errors[f"ep{ep} roundtrip"] = float(not set(hub) <= set(back) or any(not torch.equal(back[k], hub[k])
                                                                               for k in hub))
        got = generate(model, ids[:, :6].tolist(), NEW, eod=EOD, group=torch.distributed.group.WORLD).tokens
        errors[f"ep{ep} generate"] = float(got != tokens)
    return errors


def test_logits_and_greedy_generation_at_tp1_ep2_and_tp2():
    case = _case(hf_model())
    assert any(len(set(row)) > 2 for row in case[4]), "degenerate reference"
    for errors in run_distributed(_check, 2, case, timeout_s=300):
        bad = {k: v for k, v in errors.items() if v > (1e-5 if k.endswith("logits") else 0.0)}
        assert not bad, bad


def test_config_roundtrip_and_mtp_equals_transformers_mtp_model():
    hf = hf_model()
    hf_config, state, ids, ref, _ = _case(hf)
    config = config_from_hf(hf_config)
    assert (config.mtp_num_layers, config.moe.layer_pattern, config.moe.num_groups, config.moe.group_topk) == \
        (1, (0, 1, 1), 4, 2)
    model = GPTModel(config).eval()
    assert load_hf(model, state) == []
    hub = unfuse_experts(state, "deepseek_v3")
    back = to_hf_state_dict(model)
    copies = {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"}
    assert set(back) == set(hub) | copies and all(torch.equal(back[k], hub[k]) for k in hub)
    exported = hf_config_of(config, "deepseek_v3")
    keys = [k for k in CFG if not k.endswith("token_id")]
    assert {k: exported[k] for k in keys} == {k: transformers.DeepseekV3Config(**CFG).to_dict()[k] for k in keys}
    # the MTP layer against transformers' MtpModel (DeepSeek's layout through its conversion mapping)
    from transformers.modeling_layers import MtpModel
    mtp = MtpModel(hf, 1).eval()
    from megazero.checkpoint.convert.hf_moe import fuse_experts
    from megazero.moe.config import MoEConfig
    prefix = f"model.layers.{L}."
    layer = {"model.layers.0." + k[len(prefix):]: v for k, v in back.items()
             if k.startswith(prefix) and k not in copies}
    layer = fuse_experts(layer, "deepseek_v3", MoEConfig(num_experts=8, ffn_hidden_size=16, layer_pattern=(1,)))
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    fused = {("layers.0." + k[15:].replace("shared_head.norm", "post_norm")) if k[15:].startswith(own)
             else "layers.0.mtp_block." + k[15:]: v for k, v in layer.items()}
    missing, unexpected = mtp.load_state_dict(fused, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing), (missing, unexpected)
    with torch.no_grad():
        h0 = hf.model(ids).last_hidden_state
        pos = torch.arange(1, ids.shape[1] + 1).expand_as(ids)  # transformers: the embedded token's positions
        want = mtp._project_to_logits(mtp.forward_layer(0, h0, pos, None, input_ids=roll_left(ids)))
        got = _mtp_logits(model, ids)
    s = ids.shape[1] - 1  # the last position embeds the fill token 0
    assert _rel(got[:, :s], want[:, :s]) <= 1e-5


def _mtp_logits(model, ids):
    """megazero's depth-1 MTP logits ``[b, s, V]`` from the model's own pieces."""
    from megazero.model.yarn import mla_rope_cos_sin
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    rope = mla_rope_cos_sin(pos, model.config, torch.float32)
    h = model.embedding(ids, pos)
    for layer in model.layers.values():
        h = layer(h, rope)
    h = model.final_norm(h)
    h = model.mtp.layers[0](h, model.embedding(roll_left(ids), pos), rope)
    return model.output_layer(h).transpose(0, 1)[..., :VOCAB]


def test_every_group_kept_is_no_group_limit():
    """``topk_group = n_group`` (or ``n_group`` 1) keeps every group in both rules: no group limit."""
    for groups, kept in ((4, 4), (1, 1)):
        cfg = dict(transformers.DeepseekV3Config(**CFG).to_dict(), n_group=groups, topk_group=kept, num_experts_per_tok=3)
        moe = config_from_hf(cfg).moe
        assert (moe.num_groups, moe.group_topk, moe.router_topk) == (None, None, 3)


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("attention_bias", True), ("rope_interleave", False),
                                       ("norm_topk_prob", False), ("topk_group", 1), ("num_key_value_heads", 2),
                                       ("rope_parameters", {"rope_type": "linear", "factor": 2.0})])
def test_refuses_fields_megazero_does_not_implement(key, value):
    cfg = dict(transformers.DeepseekV3Config(**CFG).to_dict(), **{key: value})
    with pytest.raises(ValueError) as e:
        config_from_hf(cfg)
    assert f"{key}=" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change,key", [(dict(attention_factor=1.2), "attention_factor"),
                                        (dict(mscale=0.8, mscale_all_dim=0), "mscale")])
def test_refuses_yarn_settings_transformers_reads_otherwise(change, key):
    """An explicit ``attention_factor``, or an ``mscale`` that transformers' YaRN ignores (no
    ``mscale_all_dim``) while Megatron's rule uses it: refused, naming the key and value."""
    cfg = transformers.DeepseekV3Config(**CFG).to_dict()
    assert cfg["rope_parameters"]["factor"] > 1
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], **change)
    with pytest.raises(ValueError, match=rf"rope_parameters\.{key}=") as e:
        config_from_hf(cfg)
    assert "\n" not in str(e.value)
