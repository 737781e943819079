"""The RNG tracker: TP-region dropout differs across TP ranks, replicated dropout agrees, slices
draw independent streams, and a TP + dropout model keeps its replicated activations identical."""

import torch
import torch.distributed as dist

from megazero.model import GPTConfig, GPTModel
from megazero.tensor_parallel import RNGTracker, dropout
from megazero.tensor_parallel.random import REPLICATED, TENSOR_PARALLEL
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology


def _masks(rank, world):
    topo = Topology(world, rank, tp=world).create_groups()
    tracker = RNGTracker(5, topo.tp_rank)
    x = torch.ones(64)
    masks = {name: dropout(x, 0.5, True, tracker, name) for name in (REPLICATED, TENSOR_PARALLEL)}
    gathered = {}
    for name, m in masks.items():
        parts = [torch.empty_like(m) for _ in range(world)]
        dist.all_gather(parts, m, group=topo.tp_group)
        gathered[name] = parts
    # a TP model with dropout (no SP): the loss (replicated) agrees across TP ranks
    config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=30, seq_length=8,
                       make_vocab_size_divisible_by=2, hidden_dropout=0.3, attention_dropout=0.3)
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = GPTModel(config, topo).train()(ids, labels=ids)
    losses = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(losses, loss, group=topo.tp_group)
    return gathered, losses


def test_tp_and_replicated_streams():
    gathered, losses = run_distributed(_masks, 2)[0]
    assert torch.equal(gathered[REPLICATED][0], gathered[REPLICATED][1])
    assert not torch.equal(gathered[TENSOR_PARALLEL][0], gathered[TENSOR_PARALLEL][1])
    assert torch.equal(losses[0], losses[1])


def test_streams_and_state_roundtrip():
    a, b = RNGTracker(1, stream=0), RNGTracker(1, stream=4)
    x = torch.ones(256)
    assert not torch.equal(dropout(x, 0.5, True, a, REPLICATED), dropout(x, 0.5, True, b, REPLICATED))
    state = a.state_dict()
    first = dropout(x, 0.5, True, a, TENSOR_PARALLEL)
    a.load_state_dict(state)
    assert torch.equal(first, dropout(x, 0.5, True, a, TENSOR_PARALLEL))
    assert torch.equal(dropout(x, 0.5, False, a, REPLICATED), x)
