"""Generation with multi-latent attention: the cache holds the compressed latent (``kv_lora_rank`` +
the RoPE key part per token and layer, no K/V), and greedy decoding with it equals the full forward
recomputed at every step -- batched with left padding, without the cache, and at TP 2 (decode steps
absorb ``kv_up``: tests/model/test_mla_absorb.py)."""

import torch

from megazero.inference.generation import generate
from megazero.inference.latent_cache import LatentCache, new_cache
from megazero.model import GPTConfig, GPTModel
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.inference.test_generate import recompute_greedy

PROMPTS = [[5, 17, 3, 9, 41], [8, 2], [60, 61, 62, 63, 64, 65, 66, 70]]
NEW = 10


def config(q_lora_rank=12):
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32,
                     attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.2, seed=11,
                     position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, multi_latent_attention=True,
                     q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
                     rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.9, original_max_position_embeddings=8)


def test_the_cache_holds_latents_not_keys_and_values():
    cfg = config()
    model = GPTModel(cfg).eval()
    cache = new_cache(cfg, 2, 20)
    assert isinstance(cache, LatentCache)
    cache.prepare(step_len=7)
    with torch.no_grad():
        model(torch.randint(0, 100, (2, 7)), inference_cache=cache)
    assert not cache.keys and not cache.values
    assert {tuple(t.shape) for t in cache.latents.values()} == {(2, 20, 16)}
    assert {tuple(t.shape) for t in cache.rope_keys.values()} == {(2, 20, 4)}
    assert cache.nbytes() == 2 * 2 * 20 * (16 + 4) * 4
    assert "caches the compressed latent, not K/V: kv_lora_rank 16 + qk_pos_emb_head_dim 4" in repr(cache)
    assert "(full K/V: 96)" in repr(cache)


def test_greedy_with_the_latent_cache_equals_the_full_forward():
    for q_lora in (12, None):
        model = GPTModel(config(q_lora)).eval()
        cached = generate(model, PROMPTS, NEW).tokens
        assert cached == generate(model, PROMPTS, NEW, use_cache=False).tokens
        for prompt, row in zip(PROMPTS, cached):
            assert row == recompute_greedy(model, prompt, NEW)
            assert generate(model, [prompt], NEW).tokens == [row]
        assert len({tuple(r) for r in cached}) == 3


def _tp2(rank, world):
    topo = Topology(world, rank, tp=2).create_groups()
    return generate(GPTModel(config(), topo).eval(), PROMPTS, NEW).tokens


def test_tp2_generates_what_tp1_does():
    want = generate(GPTModel(config()).eval(), PROMPTS, NEW).tokens
    assert run_distributed(_tp2, 2) == [want, want]


def test_the_latent_cache_refuses_options_it_does_not_keep():
    import pytest
    with pytest.raises(ValueError, match="takes no window"):
        new_cache(config(), 1, 8, window=4)
    assert isinstance(new_cache(config(), 1, 8, window=None), LatentCache)
