"""ZeRO-3 builds without the whole model: the GPT is built on the meta device and each unit is
materialized straight into this rank's shard, with the eager build's values bit for bit; no rank
holds more than one unit's full parameters during the build, and saving gathers nothing. Stages
0-2 accept a meta build too, with the eager build's weights and masters bit for bit.

Counted in bytes: after the provider every parameter is still a meta tensor (0 bytes), the
region builder's peak of partitioned full parameters alive at once (``build_peak_unit_bytes``,
measured on the buffers' storages) is at most the largest unit's, and the stage-3 gatherer's
live count stays 0 through ``save_run``."""

from __future__ import annotations

import torch

from megazero.testing import run_distributed
from tests.zero.gpt_helpers import CFG, MB, args_for

TP_PP = [(1, 1), (2, 1), (1, 2)]


def _build(topo, stage, meta, dtype=torch.bfloat16):
    from megazero.config.optimizer import OptimizerConfig
    from megazero.model import GPTConfig
    from megazero.model.stages import gpt_stages
    from megazero.zero import ZeroOptimizer
    config = GPTConfig(**CFG, params_dtype=dtype)
    stages = gpt_stages(config, topo, MB, device="meta" if meta else None)
    if meta:
        assert all(p.is_meta for c in stages.chunks for p in c.parameters())
    args = args_for(stage, 1, params_dtype=dtype, zero_param_persistence_threshold=40)
    opt = ZeroOptimizer(stages.chunks, topo, **OptimizerConfig.from_args(args).kwargs(),
                        shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params,
                        param_init=stages.param_init)
    return stages, opt


def _shards(opt):
    return [(r.master.clone(), None if r.param_shard is None else r.param_shard.clone()) for r in opt.regions]


def _worker(rank, world, tp, pp, root):
    from megazero.checkpoint.api import save_run
    from megazero.parallel.topology import Topology
    topo = Topology(world, rank, tp=tp, pp=pp).create_groups()
    eager_stages, eager = _build(topo, 3, meta=False)
    stages, opt = _build(topo, 3, meta=True)
    for (m1, p1), (m2, p2) in zip(_shards(eager), _shards(opt)):
        assert torch.equal(m1, m2) and (p1 is None or torch.equal(p1, p2))
    units = [r.padded * r.param_flat.element_size() for r in opt.regions if r.partitioned]
    assert 0 < opt.build_peak_unit_bytes <= max(units)
    assert all(r.param_flat.untyped_storage().nbytes() == 0 for r in opt.regions if r.partitioned)
    with eager.gathered_params(), opt.gathered_params():  # the same full model, bit for bit
        for c1, c2 in zip(eager_stages.chunks, stages.chunks):
            a, b = c1.full_state_dict(), c2.full_state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt.gatherer.peak_live = 0
    save_run(f"{root}/tp{tp}pp{pp}", topo=topo, stages=stages, optimizer=opt, scheduler_state=None,
             counters={"skipped": 0, "nans": 0}, iteration=1, consumed_samples=0, layout={}, saved_args={})
    assert opt.gatherer.peak_live == 0  # the save gathered no unit
    for stage in (0, 1, 2):  # stages 0-2 accept the meta build too: the eager build's state and weights
        a, b = _build(topo, stage, meta=False)[1], _build(topo, stage, meta=True)[1]
        assert all(torch.equal(x[0], y[0]) for x, y in zip(_shards(a), _shards(b)))
        assert all(torch.equal(x.param_flat, y.param_flat) for x, y in zip(a.regions, b.regions))
    return True


def test_every_stage_builds_on_the_meta_device():
    from megazero.model.stages import gpt_stages, provider_options

    def provider(config, topo, micro_batch_size, device=None):
        return gpt_stages(config, topo, micro_batch_size, device=device)

    def old_provider(config, topo, micro_batch_size):
        return gpt_stages(config, topo, micro_batch_size)
    assert provider_options(provider) == {"device": "meta"}
    assert provider_options(old_provider) == {}


def test_meta_build_equals_eager_and_holds_one_unit(tmp_path):
    for tp, pp in TP_PP:
        assert all(run_distributed(_worker, tp * pp * 2, tp, pp, str(tmp_path), timeout_s=240))
