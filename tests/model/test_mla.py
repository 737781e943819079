"""Multi-latent attention (megazero/model/mla.py): transformers' DeepseekV3Attention, one process
against TP 2 / TP 2 + SP / TP 4, the YaRN numbers, and the one-line refusals.

* one MLA layer equals ``transformers`` 5.24.0 ``DeepseekV3Attention`` (YaRN with mscale, the
  interleaved pair layout, with and without ``q_lora_rank``) on the same weights, fp32, 1e-5;
* a whole MLA GPT at TP 2 (with and without SP) and TP 4: logits, loss and every gradient equal
  TP 1's (max-relative 1e-5), the replicated down projections counted as TP-duplicated.
"""

import pytest
import torch

from megazero.model import GPTConfig, GPTModel
from megazero.model.mla import MultiLatentAttention
from megazero.model.yarn import interleave_order, mla_rope_cos_sin, softmax_scale, yarn_inv_freq
from megazero.parallel.topology import Topology
from megazero.tensor_parallel import RNGTracker, gather_from_tp_region
from megazero.testing import run_distributed

MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
           make_vocab_size_divisible_by=8, position_embedding_type="rope", normalization="RMSNorm",
           activation="swiglu", ffn_hidden_size=48, add_bias_linear=False, untie_embeddings_and_output_weights=True,
           attention_dropout=0.0, hidden_dropout=0.0, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=40.0, mscale=0.707,
           mscale_all_dim=0.707, original_max_position_embeddings=8, norm_epsilon=1e-6)


def hf_attention(cfg: GPTConfig, ours: MultiLatentAttention):
    """transformers' DeepseekV3Attention with ``ours``' weights, and its rotary embedding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    hf_cfg = DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.norm_epsilon, attention_bias=False, rope_interleave=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
                         "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow,
                         "original_max_position_embeddings": cfg.original_max_position_embeddings})
    hf_cfg._attn_implementation = "sdpa"
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    names = {"q_proj": "q_proj", "q_a_proj": "q_down", "q_a_layernorm": "q_norm", "q_b_proj": "q_up",
             "kv_a_proj_with_mqa": "kv_down", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_up", "o_proj": "dense"}
    with torch.no_grad():
        for hf_name, name in names.items():
            if getattr(hf, hf_name, None) is not None:
                getattr(hf, hf_name).weight.copy_(getattr(ours, name).weight)
    return hf, DeepseekV3RotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_one_layer_equals_transformers_deepseek_v3(q_lora_rank):
    cfg = GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    ours = MultiLatentAttention(cfg, 0, None, RNGTracker(1, 0), "cpu").eval()
    with torch.no_grad():  # non-trivial norm weights
        ours.kv_norm.weight.uniform_(0.5, 1.5)
        if q_lora_rank:
            ours.q_norm.weight.uniform_(0.5, 1.5)
    hf, rotary = hf_attention(cfg, ours)
    torch.manual_seed(0)
    x = torch.randn(2, 16, cfg.hidden_size)  # [b, s, h]
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    out, _ = ours(x.transpose(0, 1), mla_rope_cos_sin(pos, cfg, torch.float32))
    ref, _ = hf(x, rotary(x, pos), None)
    err = (out.transpose(0, 1) - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err
    assert abs(softmax_scale(cfg) - hf.scaling) < 1e-12


def test_yarn_frequencies_equal_transformers_and_factor_one_is_plain_rope():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = GPTConfig(**MLA)
    hf_cfg = DeepseekV3Config(qk_rope_head_dim=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0})
    inv, c = yarn_inv_freq(cfg)
    ref_inv, ref_c = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and abs(c - ref_c) < 1e-12
    plain, c1 = yarn_inv_freq(GPTConfig(**{**MLA, "rotary_scaling_factor": 1.0}))
    assert c1 == 1.0 and torch.equal(plain, 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4))
    assert interleave_order(6).tolist() == [0, 3, 1, 4, 2, 5]


def _step(model, ids, labels, group):
    logits = gather_from_tp_region(model(ids), group)[..., :100].detach()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return logits, loss.detach(), model.full_state_dict(grads=True)


def _tp_parity(rank, world):
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    errors = {}
    for q_lora in (12, None):
        kw = {**MLA, "q_lora_rank": q_lora}
        ref = _step(GPTModel(GPTConfig(**kw)), ids, labels, None)
        for tp, sp in ((2, False), (2, True), (4, True)):
            topo = Topology(world, rank, tp=tp).create_groups()
            model = GPTModel(GPTConfig(**kw, sequence_parallel=sp), topo)
            got = _step(model, ids, labels, topo.tp_group)
            dup = {n for n, p in model.named_parameters() if any(p is d for d in model.tp_duplicated_parameters())}
            assert {n for n in dup if ".attention." in n} == {
                n for n in got[2] if any(k in n for k in ("q_down", "q_norm", "kv_down", "kv_norm"))}
            for i, name in enumerate(("logits", "loss")):
                errors[f"q{q_lora} tp{tp} sp{int(sp)} {name}"] = _rel(got[i], ref[i])
            assert got[2].keys() == ref[2].keys()
            for name in ref[2]:
                errors[f"q{q_lora} tp{tp} sp{int(sp)} grad {name}"] = _rel(got[2][name], ref[2][name])
    return errors


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_tp2_sp_and_tp4_equal_one_process():
    for errors in run_distributed(_tp_parity, 4):
        bad = {k: v for k, v in errors.items() if v > 1e-5}
        assert not bad, bad
        assert len(errors) > 60


@pytest.mark.parametrize("change, message", [
    (dict(num_query_groups=2), "mutually exclusive"),
    (dict(position_embedding_type="learned_absolute"), "--position-embedding-type rope"),
    (dict(qk_pos_emb_head_dim=3), "--qk-pos-emb-head-dim 3"),
    (dict(rope_type="ntk"), "--rope-type 'ntk'"),
    (dict(multi_latent_attention=False, rope_type="yarn"), "--rope-type yarn without"),
    (dict(add_qkv_bias=True), "--add-qkv-bias"),
])
def test_bad_settings_one_line(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GPTConfig(**{**MLA, **change})


def test_heads_that_do_not_split_over_tp():
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by TP 8"):
        GPTConfig(**MLA).check_tp(8)


def test_meta_build_draws_what_the_eager_build_does():
    """ZeRO 3's deferred build: every MLA parameter's initializer gives the eager build's value."""
    from megazero.tensor_parallel.layers import param_initializer
    for q_lora in (12, None):
        cfg = GPTConfig(**{**MLA, "q_lora_rank": q_lora, "normalization": "LayerNorm", "apply_layernorm_1p": True})
        eager, meta = GPTModel(cfg), GPTModel(cfg, meta_init=True)
        init = param_initializer([meta])
        for (name, p), (_, m) in zip(eager.named_parameters(), meta.named_parameters()):
            assert torch.equal(init(m).to(p.dtype), p.detach()), name


def _recompute_with_dropout(rank, world):
    from tests.model.test_recompute_and_slices import RECOMPUTE, _two_steps
    topo = Topology(world, rank, tp=world).create_groups() if world > 1 else None
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    kw = {**MLA, "attention_dropout": 0.2, "hidden_dropout": 0.2, "sequence_parallel": world > 1}
    ref = _two_steps(GPTModel(GPTConfig(**kw), topo).train(), ids, ids.roll(-1, 1))
    assert not torch.equal(ref[0][0], ref[1][0])  # the dropout masks differ between steps
    for rc in RECOMPUTE:
        got = _two_steps(GPTModel(GPTConfig(**kw, **rc), topo).train(), ids, ids.roll(-1, 1))
        for (loss, grads), (ref_loss, ref_grads) in zip(got, ref):
            assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items()), rc
    return True


def test_recompute_with_dropout_is_bitwise_at_tp1_and_tp2_sp():
    """Full and selective recompute replay MLA's attention-dropout masks (the TP generator) exactly."""
    assert _recompute_with_dropout(0, 1) and run_distributed(_recompute_with_dropout, 2) == [True, True]
