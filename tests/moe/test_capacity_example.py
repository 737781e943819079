"""docs/moe.md's worked example of capacity dropping, against the router's rule."""

import torch

from megazero.moe.config import MoEConfig
from megazero.moe.router import drop_over_capacity

# T 6 tokens, E 3 experts, top-2 weights (rows: tokens t0..t5)
PROBS = torch.tensor([[0.7, 0.3, 0.0], [0.6, 0.0, 0.4], [0.55, 0.45, 0.0], [0.9, 0.0, 0.1], [0.65, 0.35, 0.0],
                      [0.0, 0.8, 0.2]])


def _kept(factor=1.0, **kw):
    moe = MoEConfig(num_experts=3, ffn_hidden_size=4, layer_pattern=(1,), router_topk=2, capacity_factor=factor, **kw)
    probs, kept = drop_over_capacity(PROBS, PROBS > 0, moe)
    return probs, [[t for t in range(6) if kept[t, e]] for e in range(3)]


def test_docs_worked_example():
    probs, kept = _kept()  # C = ceil(6 * 2 / 3 * 1.0) = 4
    assert kept == [[0, 1, 3, 4], [0, 2, 4, 5], [1, 3, 5]]  # 'probs' drops t2 from expert 0
    assert probs[2].tolist() == [0.0, PROBS[2, 1].item(), 0.0]  # not renormalized
    _, kept = _kept(token_drop_policy="position")
    assert kept == [[0, 1, 2, 3], [0, 2, 4, 5], [1, 3, 5]]  # 'position' drops t4
    _, kept = _kept(pad_to_capacity=True)
    assert [len(k) for k in kept] == [4, 4, 4] and {1, 3, 5} < set(kept[2])  # one zero-weight row
    _, kept = _kept(factor=0.5)  # C = 2
    assert kept == [[0, 3], [2, 5], [1, 5]] and not any(4 in k for k in kept)
