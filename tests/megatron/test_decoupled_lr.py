"""--decoupled-lr/--decoupled-min-lr (Megatron-LM core_v0.19.0: the parameters marked
is_embedding_or_output_parameter -- word embedding and output layer -- form a param group whose
max_lr/min_lr override the schedule's peak and floor): the schedule by hand, and ZeRO 0-3 with
DP 2 equal to torch.optim.AdamW with two learning rates."""

import math

import pytest
import torch

from megazero.arguments import parse_args
from megazero.model import GPTConfig, GPTModel
from megazero.model.stages import embedding_and_output_params
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from megazero.config.run_config import lr_config
from megazero.optim.lr_schedule import LRScheduler, build_lr_scheduler, learning_rates

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data", "--vocab-size", "100",
        "--train-samples", "40", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-samples", "8",
        "--lr-decay-samples", "32", "--lr-decay-style", "cosine"]


def test_schedule_shape_with_other_peak_and_floor():
    args = parse_args(ARGV + ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "2e-4"], world_size=1)
    sched = build_lr_scheduler(lr_config(args))
    sched.num_steps = 4  # half-way through the warm-up
    assert learning_rates(sched, lr_config(args)) == pytest.approx((0.5e-3, 2.5e-3))
    sched.num_steps = 20  # (20 - 8) / (32 - 8) = 1/2 of the cosine: floor + (peak - floor) / 2
    assert learning_rates(sched, lr_config(args)) == pytest.approx((0.55e-3, 2.6e-3))
    sched.num_steps = 40
    assert learning_rates(sched, lr_config(args)) == pytest.approx((1e-4, 2e-4))
    no_floor = args.replace(decoupled_min_lr=None)
    assert learning_rates(sched, lr_config(no_floor))[1] == pytest.approx(1e-4)  # --min-lr
    assert learning_rates(sched, lr_config(args.replace(decoupled_lr=None))) == (pytest.approx(1e-4), None)
    r = 0.25
    sched.num_steps = 8 + r * 24
    assert sched.get_lr(max_lr=5e-3, min_lr=2e-4) == pytest.approx(2e-4 + 0.5 * (math.cos(math.pi * r) + 1) * 4.8e-3)
    assert isinstance(sched, LRScheduler)


CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8,
           make_vocab_size_divisible_by=8, attention_dropout=0.0, hidden_dropout=0.0)
LRS = [(1e-3, 5e-3), (2e-3, 1e-2), (5e-4, 3e-3)]


def _train(rank, world, stage, untie):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank).create_groups()
    cfg = GPTConfig(**CFG, untie_embeddings_and_output_weights=untie)
    model, ref = GPTModel(cfg, topo), GPTModel(cfg)
    opt = ZeroOptimizer([model], topo, stage=stage, lr=1.0, weight_decay=0.1, betas=(0.9, 0.95),
                        reduce_bucket_size=3000)  # several regions; the embedding's shard split over DP
    opt.set_decoupled_params(embedding_and_output_params([model]))
    special = {id(p) for p in embedding_and_output_params([ref])}
    groups = {}
    for p in ref.parameters():
        groups.setdefault((id(p) in special, p.dim() >= 2), []).append(p)
    torch_opt = torch.optim.AdamW([{"params": ps, "decoupled": d, "weight_decay": 0.1 if wd else 0.0}
                                   for (d, wd), ps in groups.items()], betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    for lr, dlr in LRS:
        tokens, labels = torch.randint(0, 50, (2, 8), generator=gen), torch.randint(0, 50, (2, 8), generator=gen)
        model(tokens, labels=labels).mean().backward()  # the same batch on both DP ranks
        ok, _ = opt.step(lr, dlr)
        assert ok
        ref(tokens, labels=labels).mean().backward()
        for g in torch_opt.param_groups:
            g["lr"] = dlr if g["decoupled"] else lr
        torch_opt.step()
        torch_opt.zero_grad()
    with opt.gathered_params():
        got = model.full_state_dict()
    want = ref.full_state_dict()
    return {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}, len(special)


@pytest.mark.parametrize("stage,untie", [(0, True), (1, True), (2, False), (3, True)])
def test_zero_equals_adamw_with_two_param_groups(stage, untie):
    for errors, n_special in run_distributed(_train, 2, stage, untie):
        assert n_special == (2 if untie else 1)
        assert max(errors.values()) < 1e-5, errors
