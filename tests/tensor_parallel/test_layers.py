"""Parallel layers == their single-process formulas, and TP-independent initialization.

On 4 ranks, for TP = 2 and 4, with and without sequence parallelism: ColumnParallelLinear
(gather_output, skip_bias_add, fused Q/K/V partitions), RowParallelLinear (input split here or
already parallel) and VocabParallelEmbedding (padded vocabulary, ids outside this rank's range
masked) give the full layer's output (fused partitions: forward only) and input/weight gradients (fp32, 1e-5); their full weights
equal the TP = 1 layers' (bitwise).
"""

import torch
import torch.nn.functional as F

from megazero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      gather_tensor, seeded_normal)
from megazero.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _layers(group, sp):
    init = lambda key: seeded_normal(0.5, 3, key)  # noqa: E731
    col = ColumnParallelLinear(8, 24, group, sequence_parallel=sp, init_method=init("col"))
    qkv = ColumnParallelLinear(8, 24, group, partition_sizes=[8, 8, 8], init_method=init("qkv"))
    col_g = ColumnParallelLinear(8, 12, group, gather_output=True, skip_bias_add=True, init_method=init("colg"))
    row = RowParallelLinear(24, 8, group, input_is_parallel=True, sequence_parallel=sp, init_method=init("row"))
    row_s = RowParallelLinear(12, 8, group, input_is_parallel=False, skip_bias_add=True, init_method=init("rows"))
    emb = VocabParallelEmbedding(16, 8, group, vocab_size=13, sequence_parallel=sp, init_method=init("emb"))
    with torch.no_grad():
        for m in (col, col_g, row, row_s):
            m.bias.copy_(m.full_to_local("bias", torch.arange(m.out_features, dtype=torch.float32) / 7))
    return col, col_g, row, row_s, emb, qkv


def _forward(layers, x, ids, group, sp, tp, r):
    col, col_g, row, row_s, emb, qkv = layers
    xin = x.chunk(tp)[r] if sp else x
    h = col(xin)                          # [s, b, 24/p]
    out = row(h)                          # [s(/p), b, 8]
    y, yb = col_g(x)                      # [s, b, 12] gathered, bias separate
    z, zb = row_s(y + yb)                 # input split inside
    e = emb(ids)                          # [s(/p), b, 8]
    if sp:
        # replicated loss downstream: each rank's gradient of the full tensor is complete
        out = gather_from_sequence_parallel_region(out, group, grad_is_partial=False)
        e = gather_from_sequence_parallel_region(e, group, grad_is_partial=False)
    fused = gather_tensor(qkv(x.detach()), 2, group, [8, 8, 8])  # rank r: [Q_r, K_r, V_r]
    return out, z + zb, e, fused


def _full_weights(layers):
    return [m.local_to_full(n, p.detach()) for m in layers for n, p in m.named_parameters()]


def _check(rank, world):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 8, generator=gen)
    ids = torch.randint(0, 13, (8, 2), generator=gen)
    ref_layers = _layers(None, False)
    xr = x.clone().requires_grad_(True)
    ref = _forward(ref_layers, xr, ids, None, False, 1, 0)
    sum(o.square().sum() for o in ref[:3]).backward()
    ref_w = _full_weights(ref_layers)
    ref_g = [m.local_to_full(n, p.grad) for m in ref_layers[:5] for n, p in m.named_parameters()]
    cases = 0
    for tp in (2, 4):
        topo = Topology(world, rank, tp=tp).create_groups()
        for sp in (False, True):
            layers = _layers(topo.tp_group, sp)
            for a, b in zip(_full_weights(layers), ref_w):
                assert torch.equal(a, b)
            xt = x.clone().requires_grad_(True)
            outs = _forward(layers, xt, ids, topo.tp_group, sp, tp, topo.tp_rank)
            for a, b in zip(outs, ref):
                _close(a, b.detach())
            # each output is replicated, so the loss is too; the TP layers' grads are the full ones
            sum(o.square().sum() for o in outs[:3]).backward()
            grads = [m.local_to_full(n, p.grad) for m in layers[:5] for n, p in m.named_parameters()]
            for a, b in zip(grads, ref_g):
                _close(a, b)
            if sp:  # this rank's sequence chunk holds its full input gradient
                _close(xt.grad.chunk(tp)[topo.tp_rank], xr.grad.chunk(tp)[topo.tp_rank])
            else:
                _close(xt.grad, xr.grad)
            cases += 1
    return cases


def test_parallel_layers():
    assert run_distributed(_check, 4) == [4] * 4
