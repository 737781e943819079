"""The seed-style DeepSpeed config (stage 3, every bucket size 1, persistence 1, reuse 1e9)
parsed by megazero.arguments trains like torch.optim.AdamW; plus single-process unit checks."""

import json

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config import OptimizerConfig
from megazero.parallel.topology import Topology
from megazero.zero import DynamicLossScaler, ZeroOptimizer, find_units
from megazero.zero.optimizer import _buckets

from .common import Net, batches, launch, max_rel, reference

SEED = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": 1, "stage3_prefetch_bucket_size": 1,
                              "stage3_param_persistence_threshold": 1, "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9}}


def _train(rank, world, args, data):
    topo = Topology(world, rank).create_groups()
    model = Net()
    opt = ZeroOptimizer([model], topo, **OptimizerConfig.from_args(args).kwargs())
    for step in data:
        for x, y in step[topo.dp_rank]:
            model(x, y).backward(opt.loss_scale / args.num_micro_batches)
        opt.finish_grad_sync()
        assert opt.step()[0]
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    # checkpoint round trip: state_dict() gathers, load_state_dict() re-reads the master shards
    sd = model.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(sd.values(), params))
    model2 = Net(seed=5)
    opt2 = ZeroOptimizer([model2], topo, **OptimizerConfig.from_args(args).kwargs())
    model2.load_state_dict(sd)
    assert all(torch.equal(a["master"], b["master"]) for a, b in zip(opt.state_dict()["shards"],
                                                                      opt2.state_dict()["shards"]))
    return params, opt.last_comm, len(opt.regions)


def test_seed_deepspeed_config_trains(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SEED))
    M = 2
    with pytest.warns(UserWarning, match="sub_group_size"):
        args = parse_args(["--deepspeed-config", str(path), "--micro-batch-size", "2", "--global-batch-size",
                           str(2 * M), "--lr", "1e-2", "--num-layers", "2", "--hidden-size", "16",
                           "--num-attention-heads", "2", "--seq-length", "8", "--adam-beta2", "0.95",
                           "--weight-decay", "0.1", "--clip-grad", "1.0"])
    assert (args.zero_stage, args.zero_reduce_bucket_size, args.zero_prefetch_bucket_size) == (3, 1, 1)
    data = batches(5, 2, M)
    results = launch(_train, 2, args, data)
    ref = reference(data, clip=1.0)
    for params, comm, nregions in results:
        assert max_rel(params, ref) <= 1e-5
        assert nregions == 4  # 3 blocks + the root unit (input, norm, head); nothing persistent (threshold 1)
        # reuse distance 1e9 keeps every unit gathered once fetched (one forward gather per step,
        # none in backward) while gradients are still reduce-scattered every micro-batch: (1 + M)Φ
        assert comm["dp_logical_multiple"] == pytest.approx(1 + M)


def test_loss_scaler_megatron_semantics():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0  # tracker not reset until growth: backs off at once
    s.update(True)
    assert s.scale == 2.0  # min scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2


def test_units_and_buckets():
    net = Net(layers=2)
    units = find_units(net)
    assert [m for m, _ in units] == [net.layers[0], net.layers[1], net]
    assert sum(len(ps) for _, ps in units) == len(list(net.parameters()))
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 5, 5, 20, 1)]
    assert [len(b) for b in _buckets(ps, 10)] == [2, 2, 1]
