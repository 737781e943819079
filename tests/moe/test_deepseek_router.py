"""DeepSeek-V3 routing (``megazero.moe.router.route`` with sigmoid scores, the expert bias,
group-limited top-k, ``routed_scaling_factor``) against ``transformers`` 5.24.0's
``DeepseekV3TopkRouter`` and Megatron-core's ``group_limited_topk`` rule, and the refusals."""

from __future__ import annotations

import pytest
import torch

from megazero.moe.config import MoEConfig
from megazero.moe.router import route


def _moe(E=8, k=4, groups=4, group_topk=2, scale=2.5):
    return MoEConfig(num_experts=E, ffn_hidden_size=4, layer_pattern=(1,), router_topk=k, score_function="sigmoid",
                     num_groups=groups, group_topk=group_topk, topk_scaling_factor=scale, enable_expert_bias=True)


def test_matches_transformers_deepseek_v3_router():
    """Same experts and weights as ``DeepseekV3TopkRouter`` (groups scored by their top-2 biased
    scores: Megatron's top-``k / group_topk`` with k / group_topk = 2), norm_topk_prob True."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
        hf.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    _, weights, idx = hf(x)
    want = torch.zeros(64, 8).scatter(1, idx, weights)
    logits = x @ hf.weight.t()
    probs, routing_map = route(logits, _moe(), hf.e_score_correction_bias)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-6)
    # the group limit binds: some token's best 4 biased scores span more than 2 groups
    biased = torch.sigmoid(logits) + hf.e_score_correction_bias
    free = torch.zeros_like(routing_map).scatter(1, biased.topk(4, dim=1)[1], True)
    assert not torch.equal(free, routing_map)
    assert (routing_map.view(64, 4, 2).any(-1).sum(-1) <= 2).all()


def test_group_score_is_sum_of_top_k_over_group_topk():
    """Megatron-core 0.16.1 ``moe_utils.group_limited_topk``: a group's score is the sum of its top
    ``k / group_topk`` scores (k=2, group_topk=2: each group's best score alone; transformers'
    fixed top-2 would keep groups 1 and 2 here, so the HF converter refuses k / topk_group != 2)."""
    moe = _moe(E=6, k=2, groups=3, group_topk=2, scale=None)
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.55, 0.5, 0.5]])  # group bests 0.9, 0.6, 0.5; top-2 sums 0.9, 1.15, 1.0
    logits = torch.log(scores / (1 - scores)).clamp(min=-30)
    _, routing_map = route(logits, moe, None)
    assert routing_map.tolist() == [[True, False, True, False, False, False]]


@pytest.mark.parametrize("kw,needle", [
    (dict(E=8, groups=3), "--moe-router-num-groups 3"),
    (dict(groups=4, group_topk=5), "--moe-router-group-topk 5"),
    (dict(E=8, k=6, groups=4, group_topk=2), "exceeds"),
])
def test_bad_groups_refused_in_one_line(kw, needle):
    with pytest.raises(ValueError) as e:
        _moe(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
