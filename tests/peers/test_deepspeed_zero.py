"""DeepSpeed 0.19.8's engine (``deepspeed.initialize``, CPU accelerator, gloo, world 2) against
megazero's ds_config path (``parse_args --deepspeed-config`` -> ZeroOptimizer +
``build_lr_scheduler``, what ``pretrain_gpt.py --deepspeed-config`` builds) on the same model,
weights, batches and ds_config -- torch's AdamW (``torch_adam``), WarmupDecayLR, clipping, GAS 2 --
at ZeRO 1, 2 and 3: the same losses, learning rates, gradient norms and final weights. The
parameter groups are Megatron-DeepSpeed's (no weight decay on biases and norms)."""

import json

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config.optimizer import OptimizerConfig
from megazero.config.run_config import lr_config
from megazero.parallel.topology import Topology
from megazero.optim.lr_schedule import build_lr_scheduler
from megazero.zero import ZeroOptimizer
from tests.zero.common import Net, batches

WORLD, GAS, MICRO, STEPS = 2, 2, 2, 5
SHAPE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"]


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                              "warmup_num_steps": 2, "total_num_steps": 6,
                                                              "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6}


def deepspeed_rank(rank, world, cfg, data):
    import deepspeed
    model = Net()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    losses, lrs, norms = [], [], []
    for step in data:
        lrs.append(engine.get_lr()[0])
        for x, y in step[rank]:
            loss = engine(x, y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    return losses, lrs, norms, params


def megazero_rank(rank, world, path, data):
    args = parse_args(["--deepspeed-config", path, *SHAPE], world_size=world, prog="pretrain_gpt.py")
    topo = Topology(world, rank).create_groups()
    model = Net()
    opt = ZeroOptimizer([model], topo, **OptimizerConfig.from_args(args).kwargs())
    sched = build_lr_scheduler(lr_config(args))
    losses, lrs, norms = [], [], []
    for step in data:
        lrs.append(sched.get_lr())
        for x, y in step[rank]:
            loss = model(x, y)
            losses.append(loss.item())
            loss.backward(opt.loss_scale / args.num_micro_batches)
        opt.finish_grad_sync()
        ok, norm = opt.step(lr=lrs[-1])
        assert ok
        sched.step()
        norms.append(norm)
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return losses, lrs, norms, params


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_as_deepspeed(tmp_path, deepspeed_ranks, stage):
    cfg = ds_config(stage)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    data = batches(STEPS, WORLD, GAS, mb=MICRO)
    theirs = deepspeed_ranks(deepspeed_rank, WORLD, cfg, data)
    ours = deepspeed_ranks(megazero_rank, WORLD, str(path), data)
    for (l1, lr1, n1, p1), (l2, lr2, n2, p2) in zip(ours, theirs):
        assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-7)
        assert lr1 == pytest.approx(lr2, rel=1e-12)
        assert n1 == pytest.approx(n2, rel=1e-5)
        assert n1[0] > 0.05  # clipping is active
        for a, b in zip(p1, p2):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
