"""ZeroOptimizer(decoupled_weight_decay=False) -- DeepSpeed's Adam with adam_w_mode false -- equals
single-process torch.optim.Adam(weight_decay=wd) (L2 decay added to the gradient before the
moments), at ZeRO stages 1 and 3 on 2 DP ranks; and differs from AdamW, so the flag is live."""

import torch

from megazero.parallel.topology import Topology

from .common import Net, batches, launch, max_rel, reference, train_zero


def _adam_l2_reference(data, *, lr=1e-2, wd=0.1, betas=(0.9, 0.95)):
    model = Net(3)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.Adam([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                           lr=lr, betas=betas, foreach=True)
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        for x, y in mbs:
            (model(x, y) / len(mbs)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _run(rank, world, data, M):
    topo = Topology(world, rank).create_groups()
    return [train_zero(topo, data, stage=s, M=M, decoupled_weight_decay=False, reduce_bucket_size=300,
                       param_persistence_threshold=0)[0] for s in (1, 3)]


def test_adam_l2_equals_torch_adam():
    M, data = 2, batches(4, 2, 2)
    l2, adamw = _adam_l2_reference(data), reference(data)
    assert max_rel(l2, adamw) > 1e-4  # the two decays really differ on this problem
    for rank_params in launch(_run, 2, data, M):
        for params in rank_params:
            assert max_rel(params, l2) <= 1e-5
