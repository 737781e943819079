"""A sliding-window model's KV cache keeps only the window and generation stays exact: cached,
batched (left padding), chunked-prefill and no-cache decoding all equal the training forward
recomputed on the whole sequence each step (whose window mask tests/model/test_qk_norm_window.py
checks against an explicit loop)."""

import pytest
import torch

from megazero.inference.cache import InferenceCache
from megazero.inference.generation import generate
from megazero.model import GPTConfig, GPTModel

PROMPTS = [[5, 17, 3, 9, 41, 7, 22, 13, 2], [8, 2], [60, 61, 62, 63, 64, 65, 66, 70]]
NEW = 14


def _model(left, qk=True):
    return GPTModel(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                              seq_length=48, attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.2, seed=5,
                              position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                              add_bias_linear=False, qk_layernorm=qk, window_size=(left, 0))).eval()


@torch.no_grad()
def _recompute(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1, :model.config.vocab_size].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("left", [0, 3, 6])
def test_windowed_generation_is_exact(left):
    model = _model(left)
    batched = generate(model, PROMPTS, NEW).tokens
    no_cache = generate(model, PROMPTS, NEW, use_cache=False).tokens
    for i, prompt in enumerate(PROMPTS):
        ref = _recompute(model, prompt, NEW)
        assert len(set(ref)) > 2 or left == 0, "degenerate reference"
        assert generate(model, [prompt], NEW).tokens[0] == ref, f"cache, prompt {i}"
        assert batched[i] == ref, f"batched with left padding, prompt {i}"
        assert no_cache[i] == ref, f"no cache, prompt {i}"


def test_cache_holds_at_most_the_window_and_chunked_prefill_is_exact():
    left = 3
    model = _model(left)
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref = model(prompt)
        cache, outs = InferenceCache(1, 32, window=left), []
        for chunk in (prompt[:, :2], prompt[:, 2:7], prompt[:, 7:8], prompt[:, 8:]):
            cache.prepare(step_len=chunk.shape[1])
            outs.append(model(chunk, inference_cache=cache))
            cache.advance()
            assert all(k.shape[2] <= left for k in cache.keys.values())
            assert cache.valid.shape[1] <= left
    assert cache.keys[0].shape[2] == left and cache.base == prompt.shape[1] - left
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-5, atol=1e-5)
