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
