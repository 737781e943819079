"""The planner's multi-latent-attention arithmetic (megazero/planner/mla_memory.py) against the real
modules: parameters per TP rank (TP 1 and 2, with and without the query latent, RMSNorm and
LayerNorm), the whole model's count, and the latent cache's bytes."""

import pytest
import torch

from megazero.inference.latent_cache import new_cache
from megazero.model import GPTConfig, GPTModel
from megazero.parallel.topology import Topology
from megazero.planner.memory import estimate, stage_params
from megazero.planner.mla_memory import kv_cache_bytes_per_token, mla_activation_delta, mla_attention_params
from megazero.testing import run_distributed

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
            position_embedding_type="rope", activation="swiglu", ffn_hidden_size=48,
            untie_embeddings_and_output_weights=True, multi_latent_attention=True, kv_lora_rank=10, qk_head_dim=8,
            qk_pos_emb_head_dim=4, v_head_dim=6)
VARIANTS = [dict(q_lora_rank=12, normalization="RMSNorm", add_bias_linear=False),
            dict(q_lora_rank=None, normalization="LayerNorm", add_bias_linear=True)]


def _counts(rank, world, variant):
    topo = Topology(world, rank, tp=world).create_groups() if world > 1 else None
    model = GPTModel(GPTConfig(**BASE, **variant), topo, meta_init=True)
    attention = sum(p.numel() for p in model.layers["0"].attention.parameters())
    return attention, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_per_tp_rank_equal_the_modules(variant):
    cfg = GPTConfig(**BASE, **variant)
    for tp in (1, 2):
        got = run_distributed(_counts, tp, variant) if tp > 1 else [_counts(0, 1, variant)]
        for attention, total in got:
            assert attention == mla_attention_params(cfg, tp)
            assert total == stage_params(cfg, tp, 1, 0)


def test_latent_cache_bytes_equal_the_formula():
    cfg = GPTConfig(**BASE, **VARIANTS[0])
    cache = new_cache(cfg, 3, 12)
    cache.prepare(step_len=5)
    with torch.no_grad():
        GPTModel(cfg).eval()(torch.randint(0, 100, (3, 5)), inference_cache=cache)
    assert cache.nbytes() == kv_cache_bytes_per_token(cfg, tp=2, value_bytes=4) * 3 * 12
    standard = GPTConfig(**{k: v for k, v in BASE.items() if k not in ("multi_latent_attention",)})
    assert kv_cache_bytes_per_token(standard, tp=2) == 2 * 2 * (4 // 2) * 8 * 2


def test_activations_count_mla_head_sizes_and_latents():
    cfg = GPTConfig(**BASE, **VARIANTS[0])
    delta = mla_activation_delta(cfg, 16, 2, 2, sp=True)
    assert delta == (4 * 4 * 12 + 4 * 4 * 6 - 8 * 32) * 16 * 2 / 2 + (4 * 12 + 4 * 10 + 2 * 4) * 16 * 2 / 2
    plain = GPTConfig(**{k: v for k, v in BASE.items() if k != "multi_latent_attention"}, normalization="RMSNorm",
                      add_bias_linear=False)
    got, ref = (estimate(c, 2, 1, 1, 0, micro_batch_size=2, micro_batches=1, sequence_parallel=True)
                for c in (cfg, plain))
    assert got.activation_bytes - ref.activation_bytes == pytest.approx(cfg.num_layers * delta)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_term_counts_the_layers_matmuls(variant):
    """Megatron's MLA FLOPs term (the throughput log line) = 3 x the forward's matmul FLOPs counted by
    torch (SDPA's counted whole, halved for the causal mask as Megatron does), plus its latent-norm
    ``+ 1`` terms (6 (r_q + r_kv) per token)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megazero.model.mla import MultiLatentAttention
    from megazero.model.mla_config import mla_attention_flops_per_token
    from megazero.model.yarn import mla_rope_cos_sin
    from megazero.tensor_parallel import RNGTracker
    from megazero.training.logger import model_flops_per_iteration
    cfg = GPTConfig(**BASE, **variant)
    layer = MultiLatentAttention(cfg, 0, None, RNGTracker(1, 0), "cpu").eval()
    b, s = 2, cfg.seq_length
    rope = mla_rope_cos_sin(torch.arange(s).expand(b, s), cfg, torch.float32)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(torch.randn(s, b, cfg.hidden_size), rope)
    counts = counter.get_flop_counts()["Global"]
    sdpa = sum(v for k, v in counts.items() if "bmm" in str(k) or "attention" in str(k))  # SDPA (q k^T, p v)
    matmuls = sum(v for k, v in counts.items() if not ("bmm" in str(k) or "attention" in str(k)))
    norms = 6 * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank)
    assert 3 * (matmuls + sdpa / 2) / (b * s) + norms == mla_attention_flops_per_token(cfg)
    plain = dict(BASE, multi_latent_attention=False, kv_channels=None, **variant)
    assert model_flops_per_iteration(cfg, 4) != model_flops_per_iteration(GPTConfig(**plain), 4)
