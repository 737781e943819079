"""Each TP mapping's forward and backward against its single-process formula, on 2 and 4 ranks.

Every rank builds the same full tensor X (and an upstream gradient G of the output's full
shape), feeds its rank-dependent input, and checks outputs and input gradients exactly
(the collectives only move or sum a few floats; sums compared with 1e-6 tolerance).
"""

import torch
import torch.distributed as dist

from megazero.tensor_parallel import mappings as M
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _run(fn, x, g):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


def _check_all(rank, world):
    checked = []
    for tp in (world, 1):
        topo = Topology(world, rank, tp=tp).create_groups()
        group, p, r = topo.tp_group, tp, topo.tp_rank
        gen = torch.Generator().manual_seed(7)
        s, b, h = 8, 2, 12
        full = torch.randn(s, b, h, generator=gen)
        per_rank = [torch.randn(s, b, h, generator=gen) for _ in range(p)]  # rank-specific tensors
        mine, total = per_rank[r], sum(per_rank)
        grads = [torch.randn(s, b, h, generator=gen) for _ in range(p)]
        gmine, gsum = grads[r], sum(grads)

        # f: identity fwd, all-reduce bwd
        y, dx = _run(lambda x: M.copy_to_tp_region(x, group), full, gmine)
        _close(y, full), _close(dx, gsum)
        # g: all-reduce fwd, identity bwd
        y, dx = _run(lambda x: M.reduce_from_tp_region(x, group), mine, gmine)
        _close(y, total), _close(dx, gmine)
        # scatter last dim fwd / all-gather last dim bwd (upstream grads replicated per chunk)
        chunk = lambda t, d: t.chunk(p, d)[r]  # noqa: E731
        gfull = grads[0]
        y, dx = _run(lambda x: M.scatter_to_tp_region(x, group), full, chunk(gfull, -1))
        _close(y, chunk(full, -1)), _close(dx, gfull)
        # gather last dim fwd / split bwd
        y, dx = _run(lambda x: M.gather_from_tp_region(x, group), chunk(full, -1), gfull)
        _close(y, full), _close(dx, chunk(gfull, -1))
        # scatter seq fwd / all-gather seq bwd
        y, dx = _run(lambda x: M.scatter_to_sequence_parallel_region(x, group), full, chunk(gfull, 0))
        _close(y, chunk(full, 0)), _close(dx, gfull)
        # gather seq fwd / reduce-scatter seq bwd (partial grads) or split bwd
        y, dx = _run(lambda x: M.gather_from_sequence_parallel_region(x, group), chunk(full, 0), gmine)
        _close(y, full), _close(dx, chunk(gsum, 0))
        y, dx = _run(lambda x: M.gather_from_sequence_parallel_region(x, group, False), chunk(full, 0), gfull)
        _close(y, full), _close(dx, chunk(gfull, 0))
        # reduce-scatter seq fwd / all-gather seq bwd
        y, dx = _run(lambda x: M.reduce_scatter_to_sequence_parallel_region(x, group), mine, chunk(gfull, 0))
        _close(y, chunk(total, 0)), _close(dx, gfull)
        # raw collectives, any dtype
        bf = mine.to(torch.bfloat16)
        _close(M.all_gather_dim0(chunk(full, 0), group), full)
        torch.testing.assert_close(M.reduce_scatter_dim0(bf, group).float(), chunk(total, 0), rtol=2e-2, atol=2e-2)
        checked.append((tp, dist.get_backend(group)))
    return checked


def test_mappings_2_and_4_ranks():
    for world in (2, 4):
        results = run_distributed(_check_all, world)
        assert results[0] == [(world, "gloo"), (1, "gloo")]
