"""megazero's routing (``megazero.moe.router.route``) = megatron-core 0.16.1's
``topk_routing_with_score_function`` (moe_utils.py) on the same logits: DeepSeek-V3's sigmoid scores
with the expert bias, group-limited top-k (the top ``k / group_topk`` group score, also where it is
not 2), the top-k scaling factor; and the softmax variants. Same experts, weights within 1e-6."""

import pytest
import torch

from megazero.moe.config import MoEConfig
from megazero.moe.router import route


@pytest.mark.parametrize("E,k,groups,group_topk,fn,pre,scale", [
    (8, 4, 4, 2, "sigmoid", False, 2.5),    # DeepSeek-V3's shape (k / group_topk = 2)
    (12, 3, 4, 1, "sigmoid", False, None),  # top-3 in one group of 3 (k / group_topk = 3)
    (16, 6, 8, 3, "sigmoid", False, 1.5),   # k / group_topk = 2 in 3 of 8 groups
    (8, 2, None, None, "softmax", False, None),
    (8, 2, 4, 2, "softmax", True, None),
])
def test_route_equals_megatron_core(E, k, groups, group_topk, fn, pre, scale):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    g = torch.Generator().manual_seed(E * 100 + k)
    logits = torch.randn(64, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.3 if fn == "sigmoid" else None
    moe = MoEConfig(num_experts=E, ffn_hidden_size=4, layer_pattern=(1,), router_topk=k, score_function=fn,
                    pre_softmax=pre, num_groups=groups, group_topk=group_topk, topk_scaling_factor=scale,
                    enable_expert_bias=bias is not None)
    probs, routing_map = route(logits, moe, bias)
    want_probs, want_map = topk_routing_with_score_function(
        logits, k, use_pre_softmax=pre, num_groups=groups, group_topk=group_topk, scaling_factor=scale,
        score_function=fn, expert_bias=bias)
    assert torch.equal(routing_map, want_map.bool())
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-6)
