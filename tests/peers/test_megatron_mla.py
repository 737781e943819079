"""megazero's multi-latent attention = megatron-core 0.16.1's ``MLASelfAttention`` (local spec,
``--qk-layernorm``: the latent norms) on the same weights at TP 1 and TP 2: YaRN RoPE with
Megatron's pair layout and concentration, the mscale softmax scale, with and without the query
latent (fp32, max-relative 1e-5). The flags' meanings are Megatron's (``MLATransformerConfig``).

megatron-core 0.16.1's local ``DotProductAttention`` takes no ``k_channels``/``v_channels`` (MLA's core
attention is Transformer Engine's there), so the spec's core attention is :class:`SDPACore`, and
without Transformer Engine its module-level ``HAVE_TE`` is set False in the forked rank (the wheel
imports TE placeholders that are not types, and ``isinstance(linear_proj, TELinear)`` fails):
``softmax(q k^T * softmax_scale + causal) v`` with the ``softmax_scale`` MLA hands it. Everything
before and after it -- projections, norms, YaRN, the scale itself -- is megatron-core's."""

import pytest
import torch

from tests.peers.megatron_helpers import cpu_shims

MLA = dict(hidden_size=32, num_attention_heads=4, kv_lora_rank=10, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, rotary_scaling_factor=40.0, mscale=0.8, mscale_all_dim=0.9,
           original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0)
NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_down", "q_layernorm": "q_norm",
         "linear_q_up_proj": "q_up", "linear_kv_down_proj": "kv_down", "kv_layernorm": "kv_norm",
         "linear_kv_up_proj": "kv_up", "linear_proj": "dense"}


def megazero_attention(q_lora_rank):
    from megazero.model import GPTConfig
    from megazero.model.mla import MultiLatentAttention
    from megazero.tensor_parallel import RNGTracker
    cfg = GPTConfig(num_layers=1, vocab_size=100, seq_length=16, position_embedding_type="rope",
                    normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0, norm_epsilon=1e-6,
                    multi_latent_attention=True, q_lora_rank=q_lora_rank, **MLA)
    torch.manual_seed(3)
    ours = MultiLatentAttention(cfg, 0, None, RNGTracker(1, 0), "cpu").eval()
    with torch.no_grad():
        for norm in ("q_norm", "kv_norm"):
            if hasattr(ours, norm):
                getattr(ours, norm).weight.uniform_(0.5, 1.5)
    return cfg, ours


class SDPACore(torch.nn.Module):
    """Causal SDPA on Megatron's ``[s, b, heads, d]`` q/k/v at the scale MLA passes; ``[s, b, heads d_v]`` out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _megatron(rank, world, q_lora_rank, full, x):
    cpu_shims()
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core import parallel_state as ps
    mla_module.HAVE_TE = False  # see the module doc (this forked rank only)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    ps.initialize_model_parallel(world, 1)
    try:
        get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.Generator().manual_seed(1).get_state()})
        cfg = MLATransformerConfig(num_layers=1, q_lora_rank=q_lora_rank, rope_type="yarn", normalization="RMSNorm",
                                   qk_layernorm=True, add_bias_linear=False, layernorm_epsilon=1e-6,
                                   tensor_model_parallel_size=world, use_cpu_initialization=True,
                                   attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False,
                                   bias_dropout_fusion=False, masked_softmax_fusion=False, **MLA)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SDPACore
        attn = build_module(spec.submodules.self_attention, config=cfg, layer_number=1).eval()
        r = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, p in attn.named_parameters():
                module = name.rsplit(".", 1)[0]
                w = full[NAMES[module]]
                if module == "linear_proj":
                    w = w.chunk(world, dim=1)[r]
                elif "layernorm" not in module:
                    w = w.chunk(world, dim=0)[r]
                p.copy_(w)
            s = x.shape[0]
            mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
            out, _ = attn(x, attention_mask=mask)
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_megazero_mla_equals_megatron_core(q_lora_rank):
    from megazero.model.yarn import mla_rope_cos_sin, softmax_scale
    from megazero.testing import run_distributed
    cfg, ours = megazero_attention(q_lora_rank)
    full = {k.rsplit(".", 1)[0]: v.detach().clone() for k, v in ours.state_dict().items()}
    x = torch.randn(16, 2, 32)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        want, _ = ours(x, mla_rope_cos_sin(pos, cfg, torch.float32))
    for tp in (1, 2):
        for got in run_distributed(_megatron, tp, q_lora_rank, full, x, timeout_s=120):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (tp, err)
    assert softmax_scale(cfg) != 1 / 12 ** 0.5  # the mscale term is exercised
