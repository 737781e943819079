"""``--overlap-param-gather`` (ZeRO 1/2: the parameter all-gather of step k left in flight until
step k+1's forward needs each bucket) and ``set_num_micro_batches`` (a batch size that changes
between steps) both reproduce single-process AdamW."""

import pytest
import torch

from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.zero.common import Net, batches, reference, train_zero


def _overlapped(rank, world, stage):
    topo = Topology(world, rank, tp=1, pp=1).create_groups()
    in_flight = []

    def pre(it, model, opt):
        in_flight.append(len(opt.param_sync.pending))
        return None

    data = batches(4, world, 2)
    params, opt, oks = train_zero(topo, data, stage=stage, M=2, reduce_bucket_size=200, pre=pre,
                                  overlap_param_gather=True)
    after = len(opt.param_sync.pending)  # gathered_params() waited for the last step's gathers
    return params, in_flight, len(opt.regions), after, all(ok for ok, _ in oks)


@pytest.mark.parametrize("stage", [1, 2])
def test_param_gather_overlaps_the_next_forward_and_matches_adamw(stage):
    ref = reference(batches(4, 2, 2))
    for params, in_flight, regions, after, ok in run_distributed(_overlapped, 2, stage):
        assert ok and regions > 1
        assert in_flight[0] == 0 and all(n == regions for n in in_flight[1:]), in_flight  # all in flight
        assert after == 0
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def _changing_batch(rank, world, stage, counts):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank, tp=1, pp=1).create_groups()
    model = Net(3)
    opt = ZeroOptimizer(model, topo, stage=stage, num_micro_batches=counts[0], lr=1e-2, weight_decay=0.1,
                        betas=(0.9, 0.95), reduce_bucket_size=200)
    for step, m in zip(batches_of(counts, world), counts):
        opt.set_num_micro_batches(m)
        for x, y in step[topo.dp_rank]:
            model(x, y).backward(opt.loss_scale / m)
        assert opt.step()[0]
    with opt.gathered_params():
        return [p.detach().float().clone() for p in model.parameters()]


def batches_of(counts, dp):
    """One step per count: ``batches(1, dp, m)`` with a seed per step."""
    return [batches(1, dp, m, seed=10 + k)[0] for k, m in enumerate(counts)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_number_of_micro_batches_may_change_between_steps(stage):
    counts = [1, 3, 2, 4]
    ref = reference(batches_of(counts, 2))
    for params in run_distributed(_changing_batch, 2, stage, counts):
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
