"""Multi-token prediction (megazero.model.mtp): the math against explicit shifts, and every
layout (PP 2, TP 2 with SP, MoE at PP 2 x EP 2) = one process, the MTP losses included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.model import GPTModel
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.moe.helpers import args_for, gpt_batches, moe_config, reference, train
from tests.moe.test_equivalence import DSV3

DENSE = dict(num_experts=None, normalization="RMSNorm", position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


# DeepSeek-V3 in small: MLA (q and kv latents, YaRN), the sigmoid group-limited MoE (tests/moe), one MTP layer
DSV3_MLA = dict(DSV3, normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4,
                v_head_dim=4, rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=1.0,
                original_max_position_embeddings=4, mtp_num_layers=1)


def _explicit(model, tokens, labels, c, D):
    """``lm + (c / D) sum_k L_k`` by slicing: depth k sees positions ``i < s - k``, embeds
    ``t[i + k]`` and predicts ``labels[i + k]`` (no roll, no mask)."""
    s = tokens.shape[1]
    pos = torch.arange(s).expand_as(tokens)
    from megazero.model.attention import rope_cos_sin
    h = model.embedding(tokens, pos)
    rope = rope_cos_sin(pos, model.config.kv_channels, model.config.rotary_base, torch.float32)
    for layer in model.layers.values():
        h = layer(h, rope)
    h = model.final_norm(h)
    logits = model.output_layer(h)
    total = F.cross_entropy(logits[..., :model.config.vocab_size].flatten(0, 1), labels.t().flatten())
    for k, mtp in enumerate(model.mtp.layers, start=1):
        n = s - k
        e = model.embedding(tokens[:, k:], pos[:, :n])
        rope_n = rope_cos_sin(pos[:, :n], model.config.kv_channels, model.config.rotary_base, torch.float32)
        h = mtp(h[:n], e, rope_n)
        logits = model.output_layer(h)[..., :model.config.vocab_size]
        total = total + (c / D) * F.cross_entropy(logits.flatten(0, 1), labels[:, k:].t().flatten())
    return total


def test_equals_explicit_shifts_and_gradient():
    torch.manual_seed(0)
    model = GPTModel(moe_config(**DENSE, seq_length=8))
    model.moe_state.set_aux_scale(1.0)
    text = torch.randint(0, 40, (2, 9))
    tokens, labels = text[:, :-1], text[:, 1:]
    lm = model(tokens, labels=labels).mean()
    lm.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = _explicit(model, tokens, labels, 0.3, 2)
    want.backward()
    mtp = model.moe_state.take()["mtp_loss"][:2]
    torch.testing.assert_close(lm + 0.3 / 2 * mtp.sum(), want, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert any(n.startswith("mtp.layers.1.eh_proj") for n in got)


def _layouts(rank, world, sizes, stages, data, overrides):
    torch.set_num_threads(1)
    topo = Topology(world, rank, **sizes).create_groups()
    out = []
    for stage in stages:
        log = []
        losses, _ = train(topo, data, args_for(stage, 2), mtp_log=log, **overrides)
        out.append((losses, log))
    return out


@pytest.mark.parametrize("sizes,overrides", [
    (dict(pp=2), DENSE),
    (dict(tp=2), dict(DENSE, sequence_parallel=True)),
    (dict(pp=2, ep=2), dict(mtp_num_layers=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            untie_embeddings_and_output_weights=True, position_embedding_type="rope")),
    (dict(tp=2, ep=2), dict(DSV3_MLA, sequence_parallel=True)),
    (dict(pp=2, vp=2), DENSE),
    (dict(pp=2, pipeline_schedule="zb-h1"), DENSE),
    (dict(pp=2, vp=2, pipeline_schedule="interleaved-zb"), DENSE),
], ids=["pp2", "tp2-sp", "moe-pp2-ep2", "dsv3-mla-tp2-sp-ep2", "pp2-vp2", "pp2-zb-h1", "pp2-vp2-interleaved-zb"])
def test_layout_equals_one_process(sizes, overrides):
    dp = 4 // (sizes.get("tp", 1) * sizes.get("pp", 1))
    data = gpt_batches(3, dp, 2)
    ref_mtp = []
    ref, _ = reference(data, mtp_log=ref_mtp, **{k: v for k, v in overrides.items() if k != "sequence_parallel"})
    results = run_distributed(_layouts, 4, sizes, (1, 3), data, overrides, timeout_s=300)
    for s in range(2):
        losses = next(r[s][0] for r in results if r[s][0] is not None)
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)
        mtp = results[0][s][1]
        assert min(min(x) for x in ref_mtp) > 1.0  # cross entropies of a 40-token vocabulary, recorded
        assert max(abs(a - b) for x, y in zip(mtp, ref_mtp) for a, b in zip(x, y)) < 1e-5, (mtp, ref_mtp)


@pytest.mark.parametrize("pp,overrides", [(1, DENSE), (2, DENSE), (2, dict(mtp_num_layers=2, untie_embeddings_and_output_weights=True, position_embedding_type="rope"))],
                         ids=["dense-pp1", "dense-pp2", "moe-pp2"])
def test_planner_counts_mtp_layers(pp, overrides):
    """The planner's parameters of the last pipeline rank = the built last stage's (MTP layers, their
    norms and eh_proj, the embedding copy at PP 2; an MoE MTP layer's experts as experts)."""
    from megazero import planner as plan
    from megazero.model.stages import expert_parallel_params
    shape = moe_config(**overrides)
    L = shape.num_layers
    model = GPTModel(shape, None, L - L // pp, L, pre_process=pp == 1, post_process=True)
    dense, expert = plan.stage_param_split(shape, 1, pp, pp - 1)
    experts = sum(p.numel() for p in expert_parallel_params([model]))
    assert (dense, expert) == (sum(p.numel() for p in model.parameters()) - experts, experts)
    assert plan.estimate(shape, 1, pp, 1, 0, micro_batch_size=1, micro_batches=2).activation_bytes > \
        plan.estimate(moe_config(**dict(overrides, mtp_num_layers=None)), 1, pp, 1, 0, micro_batch_size=1,
                      micro_batches=2).activation_bytes


def test_planner_mtp_layers_stored_under_block_recompute():
    """Full recompute, block method: megazero (as megatron-core 0.16.1) leaves the MTP layers stored,
    so they add what they add without recompute; uniform recomputes them (less)."""
    from megazero import planner as plan

    def mtp_extra(recompute, method):
        kw = dict(micro_batch_size=1, micro_batches=2, recompute=recompute, recompute_method=method,
                  recompute_num_layers=1 if recompute else None)
        return plan.estimate(moe_config(**DENSE), 1, 1, 1, 0, **kw).activation_bytes - \
            plan.estimate(moe_config(**dict(DENSE, mtp_num_layers=None)), 1, 1, 1, 0, **kw).activation_bytes
    stored, block, uniform = mtp_extra(None, None), mtp_extra("full", "block"), mtp_extra("full", "uniform")
    assert stored > 0 and block == pytest.approx(stored) and uniform < block, (stored, block, uniform)


def test_throughput_flops_count_mtp_as_megatron():
    """Megatron's ``num_floating_point_operations``: each MTP depth adds ``6 B s (3h + 2h^2)`` (norms,
    eh_proj) and a logit layer ``6 B s h V``."""
    from megazero.training.logger import model_flops_per_iteration
    with_mtp, plain = moe_config(**DENSE), moe_config(**dict(DENSE, mtp_num_layers=None))
    h, V, B, s, D = 16, plain.padded_vocab(1), 4, plain.seq_length, 2
    extra = model_flops_per_iteration(with_mtp, B) - model_flops_per_iteration(plain, B)
    assert abs(extra - 6 * B * s * D * (3 * h + 2 * h * h + h * V)) < 1e-6 * extra


def test_last_stage_embedding_copy_is_shared_and_on_the_decoupled_lr():
    """PP 2: the last stage's MTP embedding copy is the weight kept in sync with the first stage's
    embedding and, like it, an ``--decoupled-lr`` parameter (the copies must take the same step)."""
    from megazero.model.stages import embedding_and_output_params
    cfg = moe_config(**DENSE)
    first = GPTModel(cfg, None, 0, 2, pre_process=True, post_process=False)
    last = GPTModel(cfg, None, 2, 4, pre_process=False, post_process=True)
    copy = last.mtp.embedding.word_embeddings.weight
    assert last.shared_embedding_weight() is copy and first.shared_embedding_weight() is first.embedding.word_embeddings.weight
    assert torch.equal(copy, first.embedding.word_embeddings.weight)
    assert any(p is copy for p in embedding_and_output_params([last]))
