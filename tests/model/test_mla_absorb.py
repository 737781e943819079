"""Weight absorption in MLA decoding (megazero/model/mla.py ``absorbed_attention``,
megazero/inference/latent_cache.py ``attend_latent``): decode steps attend over the cached latents
with ``kv_up`` folded into the query and the output, never expanding the cache.

* greedy decoding of left-padded prompts gives the same tokens with and without absorption, the
  per-step logits equal within 1e-5 (fp32), with and without ``q_lora_rank``, at TP 1 and TP 2;
* bf16: the absorbed logits stay as close to the fp32 ones as the expanded path's do;
* ``kv_up`` runs only in the prefill when absorbing (0 calls in decode steps), every step when not;
* the absorbed attention is exact also for several tokens after a prefix (chunked), padded or not;
* which steps absorb: Megatron's decode-only rule.
"""

from dataclasses import replace

import torch

from megazero.inference.generation import last_logits, left_pad
from megazero.inference.latent_cache import LatentCache
from megazero.model import GPTModel
from megazero.model.mla import MultiLatentAttention
from megazero.model.yarn import mla_rope_cos_sin
from megazero.parallel.topology import Topology
from megazero.tensor_parallel import RNGTracker
from megazero.testing import run_distributed
from tests.model.test_mla_generate import PROMPTS, config

NEW = 8


def decode(model, absorb, forced=None):
    """Greedy decoding of the left-padded ``PROMPTS`` (or feeding ``forced [b, NEW]``) with a
    :class:`LatentCache`: the tokens, each step's full last-position logits and ``kv_up`` calls
    per decode step."""
    tokens, valid = left_pad(PROMPTS, 0)
    cache = LatentCache(len(PROMPTS), tokens.shape[1] + NEW, config=model.config, absorb=absorb)
    calls = []
    hooks = [layer.attention.kv_up.register_forward_hook(lambda *_: calls.append(1))
             for layer in model.layers.values()]
    out, logits, decode_calls = [], [], []
    step_input = tokens
    with torch.no_grad():
        for step in range(NEW):
            cache.prepare(valid if step == 0 else None, step_len=step_input.shape[1])
            calls.clear()
            logits.append(last_logits(model, model(step_input, inference_cache=cache)).float())
            cache.advance()
            if step > 0:
                decode_calls.append(len(calls))
            nxt = logits[-1].argmax(-1) if forced is None else forced[:, step]
            out.append(nxt)
            step_input = nxt.view(-1, 1)
    for h in hooks:
        h.remove()
    return torch.stack(out, 1), logits, decode_calls


def check_equal(model):
    """Absorbed and expanded decoding agree (tokens; logits within 1e-5 of their size)."""
    got, got_logits, calls = decode(model, True)
    want, want_logits, ref_calls = decode(model, False)
    assert torch.equal(got, want)
    assert calls == [0] * (NEW - 1) and ref_calls == [model.config.num_layers] * (NEW - 1)
    for a, b in zip(got_logits, want_logits):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
    return want


def test_absorbed_decoding_equals_the_expanded_one():
    for q_lora in (12, None):
        torch.manual_seed(0)
        tokens = check_equal(GPTModel(config(q_lora)).eval())
        assert len({tuple(r.tolist()) for r in tokens}) == 3


def _tp2(rank, world, q_lora):
    topo = Topology(world, rank, tp=2).create_groups()
    return check_equal(GPTModel(config(q_lora), topo).eval()).tolist()


def test_tp2_absorbed_decoding_equals_tp1():
    for q_lora in (12, None):
        want = decode(GPTModel(config(q_lora)).eval(), False)[0].tolist()
        assert run_distributed(_tp2, 2, q_lora) == [want, want]


def test_bf16_absorbed_logits_as_close_to_fp32_as_the_expanded_ones():
    tokens, ref, _ = decode(GPTModel(config()).eval(), False)
    bf16 = GPTModel(replace(config(), params_dtype=torch.bfloat16)).eval()
    _, absorbed, calls = decode(bf16, True, forced=tokens)
    _, expanded, _ = decode(bf16, False, forced=tokens)
    assert calls == [0] * (NEW - 1)
    for step, (a, e, r) in enumerate(zip(absorbed, expanded, ref)):
        scale = r.abs().max()
        err_a, err_e = ((a - r).abs().max() / scale, (e - r).abs().max() / scale)
        assert err_a < 6e-2 and err_a < 1.5 * err_e + 1e-2, (step, err_a, err_e)
        assert (a - e).abs().max() < 6e-2 * scale


def test_absorbed_attention_is_exact_for_chunks_after_a_prefix():
    """Prefill 4, a chunk of 3, one token; ``kv_up`` changed in place between steps (the absorbed
    weights are read at each call: nothing stale)."""
    cfg = config()
    layer = MultiLatentAttention(cfg, 0, None, RNGTracker(1, 0), "cpu").eval()
    torch.manual_seed(1)
    x = torch.randn(8, 2, cfg.hidden_size)
    for valid in (None, torch.tensor([[False, False, True, True, True, True, True, True]] + [[True] * 8])):
        cache = LatentCache(2, 8, config=cfg)
        with torch.no_grad():
            for lo, hi in ((0, 4), (4, 7), (7, 8)):
                pos = cache.prepare(None if valid is None else valid[:, lo:hi], step_len=hi - lo)
                q, c_kv, k_r = layer.latents(x[lo:hi], mla_rope_cos_sin(pos, cfg, torch.float32))
                c_all, k_all = cache.update_latent(0, c_kv.transpose(0, 1), k_r[:, 0])
                k, v = layer.expand(c_all.transpose(0, 1), k_all.unsqueeze(1))
                want = cache.attend(layer.prescaled(q), k, v)
                got = layer.absorbed_attention(q, cache)
                assert (got - want).abs().max() < 1e-5 * want.abs().max()
                cache.advance()
                layer.kv_up.weight.mul_(1.5)


def test_decode_only_steps_absorb():
    cache = LatentCache(2, 8)
    cache.prepare(step_len=1)
    assert not cache.absorbs()  # a one-token prompt is a prefill
    cache.advance()
    cache.prepare(step_len=1)
    assert cache.absorbs()
    cache.advance()
    cache.prepare(step_len=2)
    assert not cache.absorbs()  # several tokens after a prefix: expanded
    off = LatentCache(2, 8, absorb=False)
    off.prepare(step_len=3)
    off.advance()
    off.prepare(step_len=1)
    assert not off.absorbs()
