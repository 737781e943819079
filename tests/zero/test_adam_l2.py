"""ZeroOptimizer(decoupled_weight_decay=False) -- DeepSpeed's Adam with adam_w_mode false -- equals
single-process torch.optim.Adam(weight_decay=wd) (L2 decay added to the gradient before the
moments), at ZeRO stages 1 and 3 on 2 DP ranks; and differs from AdamW, so the flag is live."""

import torch

from megazero.parallel.topology import Topology

from .common import batches, launch, max_rel, reference, train_zero


def _run(rank, world, data, M):
    topo = Topology(world, rank).create_groups()
    return [train_zero(topo, data, stage=s, M=M, decoupled_weight_decay=False, reduce_bucket_size=300,
                       param_persistence_threshold=0)[0] for s in (1, 3)]


def test_adam_l2_equals_torch_adam():
    M, data = 2, batches(4, 2, 2)
    l2, adamw = reference(data, optimizer=torch.optim.Adam), reference(data)
    assert max_rel(l2, adamw) > 1e-4  # the two decays really differ on this problem
    for rank_params in launch(_run, 2, data, M):
        for params in rank_params:
            assert max_rel(params, l2) <= 1e-5
