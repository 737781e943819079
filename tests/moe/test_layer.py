"""The MoE block against plain per-token PyTorch: routing, dropping, the aux losses and their
gradient, recomputation, the dispatch volume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.model import GPTModel
from megazero.moe.config import MoEConfig, layer_pattern
from megazero.moe.router import drop_over_capacity, route
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.moe.helpers import moe_config


def _layer(**overrides):
    model = GPTModel(moe_config(**overrides))
    return model, model.layers["0"].mlp


def _naive(mlp, x):
    """``sum_{e in top-k} p_e Expert_e(x_t)`` token by token (Mixtral's rule: softmax over the k
    largest logits), plus the gated shared expert."""
    moe = mlp.moe
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = mlp.router.weight @ x[t]
        top, idx = logits.topk(moe.router_topk)
        for p, e in zip(torch.softmax(top, -1), idx.tolist()):
            w1, w2 = mlp.experts[str(e)].fc1.weight, mlp.experts[str(e)].fc2.weight
            gate, up = (w1 @ x[t]).chunk(2)
            out[t] += p * (w2 @ (F.silu(gate) * up))
    return out


def test_layer_equals_per_token_loop():
    model, mlp = _layer()
    model.eval()
    x = torch.randn(6, 2, 16)
    y, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(y.reshape(12, 16), _naive(mlp, x.reshape(12, 16)), rtol=1e-5, atol=1e-6)


def test_routing_variants():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 0.9]])
    base = MoEConfig(num_experts=4, ffn_hidden_size=4, layer_pattern=(1,), router_topk=2)
    probs, rmap = route(logits, base, None)  # softmax over the top 2 logits
    assert rmap.tolist() == [[False, True, True, False], [True, False, False, True]]
    torch.testing.assert_close(probs[0, 1:3], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    pre = MoEConfig(num_experts=4, ffn_hidden_size=4, layer_pattern=(1,), router_topk=2, pre_softmax=True,
                    topk_scaling_factor=2.0)
    probs, _ = route(logits, pre, None)  # softmax over all 4, no renormalization, scaled
    torch.testing.assert_close(probs[0, 1], 2.0 * torch.softmax(logits[0], -1)[1])
    grouped = MoEConfig(num_experts=4, ffn_hidden_size=4, layer_pattern=(1,), router_topk=2,
                        score_function="sigmoid", num_groups=2, group_topk=1)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # the bias picks expert 3's group, not the weights
    probs, rmap = route(logits, grouped, bias)
    assert rmap[0].tolist() == [False, False, True, True]
    s = torch.sigmoid(logits[0, 2:])
    torch.testing.assert_close(probs[0, 2:], s / s.sum())


def test_capacity_drops_by_rule_worked_example():
    """T 4 tokens, k 1, E 2, factor 1: capacity ceil(4 * 1 / 2 * 1) = 2 per expert. Expert 0 is
    chosen by tokens 0, 1, 2: 'probs' keeps the two highest weights (tokens 2 and 0), 'position'
    the first two (0, 1); padding to capacity computes exactly 2 rows per expert."""
    probs = torch.tensor([[0.6, 0.0], [0.55, 0.0], [0.9, 0.0], [0.0, 0.7]])
    rmap = probs > 0
    moe = MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,), router_topk=1, capacity_factor=1.0)
    kept, kmap = drop_over_capacity(probs, rmap, moe)
    assert kmap[:, 0].tolist() == [True, False, True, False] and kmap[:, 1].tolist() == [False, False, False, True]
    assert kept[1, 0] == 0
    pos = MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,), router_topk=1, capacity_factor=1.0,
                    token_drop_policy="position", pad_to_capacity=True)
    _, pmap = drop_over_capacity(probs, rmap, pos)
    assert pmap.sum(0).tolist() == [2, 2] and pmap[:2, 0].all()


def test_aux_and_z_losses_reach_the_gradient_not_the_output():
    """The router's gradient with aux/z losses equals the gradient of ``lm + c * aux + c_z * z``
    computed by hand; the forward output does not change."""
    torch.manual_seed(0)
    model, mlp = _layer(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    plain, plain_mlp = _layer(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    x = torch.randn(4, 2, 16)
    y, _ = mlp(x)
    y2, _ = plain_mlp(x)
    torch.testing.assert_close(y, y2)
    y.sum().backward()
    logits = F.linear(x.reshape(8, 16), plain_mlp.router.weight)
    scores = torch.softmax(logits, -1)
    counts = torch.zeros(4).scatter_add(0, scores.topk(2)[1].flatten(), torch.ones(16))
    aux = (scores.sum(0) * counts).sum() * 4 * 0.5 / (2 * 8 * 8)
    z = torch.logsumexp(logits, -1).square().mean() * 0.1
    y2.sum().backward(retain_graph=True)
    (aux + z).backward()
    torch.testing.assert_close(mlp.router.weight.grad, plain_mlp.router.weight.grad, rtol=1e-5, atol=1e-7)
    sums = model.moe_state.take()
    assert abs(sums["load_balancing_loss"][0].item() - aux.item() / 0.5) < 1e-5


def test_full_recompute_counts_once():
    """Recomputing the layers in backward gives the same gradients and records each metric once."""
    grads, metrics = [], []
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = GPTModel(moe_config(recompute_granularity=recompute, moe_router_enable_expert_bias=True,
                                    moe_router_score_function="sigmoid"))
        ids = torch.randint(0, 40, (2, 8))
        model(ids, labels=ids).mean().backward()
        grads.append(model.layers["0"].mlp.router.weight.grad.clone())
        metrics.append((model.moe_state.take()["load_balancing_loss"].clone(),
                        model.layers["0"].mlp.router.tokens_per_expert.clone()))
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(metrics[0][0], metrics[1][0])
    torch.testing.assert_close(metrics[0][1], metrics[1][1])
    assert metrics[0][1].sum() == 2 * 8 * 2  # T k pairs, once


def _volume(rank, world):
    torch.set_num_threads(1)
    topo = Topology(world, rank, ep=world).create_groups()
    torch.manual_seed(rank)
    model = GPTModel(moe_config(), topo)
    mlp = model.layers["0"].mlp
    x = torch.randn(8, 2, 16)
    mlp(x)
    probs, rmap = mlp.router(x.reshape(16, 16), (8, 2))
    lo, hi = mlp.local
    remote = int(rmap.sum() - rmap[:, lo:hi].sum())
    return mlp.stats["sent_rows"], remote, int(rmap.sum())


def test_alltoall_sends_only_pairs_whose_expert_is_remote():
    """Volume per direction = the (token, expert) pairs whose expert lives on another EP rank,
    ``<= T k`` rows of ``h`` elements (the ZeRO-style accounting of docs/moe.md)."""
    for sent, remote, pairs in run_distributed(_volume, 2):
        assert sent == remote and 0 < sent <= pairs == 16 * 2


def test_layer_freq_syntax_and_errors():
    assert layer_pattern("([1]*2+[0])*2", 6) == (1, 1, 0, 1, 1, 0)
    assert layer_pattern(3, 4) == (1, 0, 0, 1)
    with pytest.raises(ValueError, match="needs 4 entries"):
        layer_pattern("[1,0]", 4)
    with pytest.raises(ValueError, match="only lists, ints"):
        layer_pattern("[__import__('os')]", 1)
    with pytest.raises(ValueError, match="between 1 and --num-experts"):
        MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,), router_topk=3)
    with pytest.raises(ValueError, match="must be > 0"):
        MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,), capacity_factor=-1.0)
    with pytest.raises(ValueError, match="'flex' needs DeepEP"):
        MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,), token_dispatcher="flex")
    assert math.isclose(MoEConfig(num_experts=2, ffn_hidden_size=4, layer_pattern=(1,),
                                  load_balancing=("aux_loss", "seq_aux_loss"),
                                  aux_loss_coeff=(0.1, 0.2)).coeff("seq_aux_loss"), 0.2)
