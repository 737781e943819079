"""Bounds on the step's transient host memory (docs/benchmarks.md, "Memory"): the stage-2/3
gradient reductions in flight never keep more than the largest non-root unit's gradient (stage
3) or one reduce bucket's (stage 2) alive besides the newest, and gloo's list all-gather, run in pieces, gives the unchunked result and
counts one call of the same volume."""

from __future__ import annotations

import torch

from megazero.parallel.topology import Topology
from megazero.testing import run_distributed

from .common import Net, batches


def _gather(rank, world):
    from megazero.zero.collectives import Collectives, process_groups
    topo = Topology(world, rank).create_groups()
    groups, _ = process_groups(topo, [])
    comm = Collectives(groups, "gloo")
    shard = torch.arange(10, dtype=torch.float32) + 100 * rank
    whole = torch.empty(10 * world)
    comm.all_gather(whole, shard, "dp").wait()
    comm.list_gather_elems = 6  # pieces of 3 elements per rank: 4 calls of the primitive
    pieces = torch.full((10 * world,), -1.0)
    comm.all_gather(pieces, shard, "dp", async_op=True).wait()
    stats = comm.reset()["dp/all_gather"]
    return torch.equal(whole, pieces), stats["calls"], stats["logical_elems"]


def test_list_all_gather_in_pieces_is_the_same():
    for same, calls, elems in run_distributed(_gather, 2):
        assert same and calls == 2 and elems == 2 * 20


def _inflight(rank, world, stage):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank).create_groups()
    model = Net(layers=4)
    opt = ZeroOptimizer(model, topo, stage=stage, lr=1e-3, reduce_bucket_size=300, param_persistence_threshold=0,
                        max_reuse_distance=0)
    seen = []
    for p in model.parameters():  # after the optimizer's own hook: what is still in flight
        p.register_post_accumulate_grad_hook(lambda p: seen.append((len(opt._inflight),
                                                                    sum(b for _, b in opt._inflight))))
    for step in batches(2, world, 1):
        for x, y in step[rank]:
            (model(x, y) * opt.loss_scale).backward()
        opt.step()
    layers = set(model.layers.parameters())
    layer = max((r.padded * 4 for r in opt.regions if r.partitioned and r.params[0] in layers), default=0)
    return opt._inflight_budget, layer, seen, [(r.numel, len(r.params)) for r in opt.regions]


def test_reductions_in_flight_bounded_by_bytes():
    for stage in (2, 3):
        for budget, layer, seen, regions in run_distributed(_inflight, 2, stage):
            if stage == 3:
                assert budget == layer  # one transformer layer's fp32 gradient
            else:  # one 300-element bucket; buckets never pass it but for a lone larger parameter (DeepSpeed)
                assert budget == 300 * 4
                assert all(n <= 300 or k == 1 for n, k in regions) and any(k > 1 for _, k in regions), regions
            assert max(b for _, b in seen) > 0, "reductions were in flight"
            assert all(n <= 1 or b <= budget for n, b in seen), (stage, budget, seen)  # or only the newest


def test_regions_are_built_largest_first_and_kept_in_reduction_order():
    """The largest region's construction transient (its parameters drawn or copied) comes before
    the other regions' states exist; the list stays in reduction order."""
    from megazero.zero.regions import largest_first
    built = []

    class Ctx:
        def region(self, params, chunk, **keywords):
            built.append(sum(p.numel() for p in params))
            return params, chunk, keywords

    specs = [([torch.zeros(3)], 0, {}), ([torch.zeros(50), torch.zeros(1)], 0, {}), ([torch.zeros(7)], -1, {"shared": "t"})]
    out = largest_first(Ctx(), specs)
    assert built == [51, 7, 3]
    assert [(sum(p.numel() for p in ps), c, kw) for ps, c, kw in out] == [(3, 0, {}), (51, 0, {}), (7, -1, {"shared": "t"})]


def _root_held(rank, world, tied):
    """ZeRO-3 GPT (DP 2, M = 2): whether the root unit (embeddings, final norm, output layer) is
    gathered when the first layer's backward is done, per micro-batch; and the trained weights."""
    from tests.zero.gpt_helpers import args_for, gpt_batches, gpt_train
    topo = Topology(world, rank).create_groups()
    seen = []

    def watch(chunks, opt):
        root = next(u for u in opt.gatherer.units if u.root)

        def pre(module, args):
            if torch.is_grad_enabled():
                args[0].register_hook(lambda g: seen.append(root.region.gathered))
        chunks[0].layers["0"].register_forward_pre_hook(pre)
    args = args_for(3, 2, adam_eps=1e-6, lr=1e-3, clip_grad=0.05)  # test_compose_gpt's settings
    full, multiple = gpt_train(topo, gpt_batches(2, world, 2), args, tied=tied, inspect=watch)
    return seen, multiple, full


def test_stage3_root_unit_released_before_the_layers_backward():
    """The root unit's parameters are read in backward only by the final norm and output layer
    (the embeddings' backward adds rows), so it is released once the final norm's input gradient
    exists, not held through the layers' backward until the tied embedding's gradient arrives;
    the number of gathers (3 x the volume) and the trained weights do not change."""
    from tests.zero.gpt_helpers import compare, gpt_batches, gpt_reference
    for tied in (True, False):
        ref = gpt_reference(gpt_batches(2, 2, 2), tied=tied, eps=1e-6, lr=1e-3, clip=0.05)
        for seen, multiple, full in run_distributed(_root_held, 2, tied):
            assert seen == [False] * 4, seen  # 2 steps x 2 micro-batches, never held
            assert multiple == 3.0 * 2  # M = 2: two gathers and a reduce-scatter per micro-batch
            assert compare(full, ref) <= 1e-5
