"""Vocab-parallel cross-entropy == F.cross_entropy on the gathered logits (fp32, 1e-6).

Padded vocabulary (K = 37 real of V' = 40 / 48 entries): padded entries get no probability
mass and zero gradient. Also label smoothing, ignore_index and bf16 logits, on TP = 1, 2, 4; the
input logits are never written (the function works in place in a buffer of its own).
"""

import torch
import torch.nn.functional as F

from megazero.tensor_parallel import vocab_parallel_cross_entropy
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology

K = 37


def _check(rank, world):
    out = []
    for tp in (1, 2, 4):
        topo = Topology(world, rank, tp=tp).create_groups()
        for padded in (40, 48):
            if padded % tp:
                continue
            gen = torch.Generator().manual_seed(padded)
            full = 3 * torch.randn(3, 5, padded, generator=gen)
            labels = torch.randint(0, K, (3, 5), generator=gen)
            labels[0, 1] = -100
            g = torch.rand(3, 5, generator=gen)
            for eps in (0.0, 0.1):
                for dtype in (torch.float32, torch.bfloat16):
                    x = full.to(dtype).chunk(tp, -1)[topo.tp_rank].clone().requires_grad_(True)
                    loss = vocab_parallel_cross_entropy(x, labels, topo.tp_group, K, label_smoothing=eps)
                    loss.backward(g)
                    # the in-place softmax buffer is the function's own: the caller's logits are intact
                    assert torch.equal(x.detach(), full.to(dtype).chunk(tp, -1)[topo.tp_rank])
                    ref_x = full.to(dtype).float().clone().requires_grad_(True)
                    ref = F.cross_entropy(ref_x[..., :K].reshape(-1, K), labels.reshape(-1), label_smoothing=eps,
                                          reduction="none").view(3, 5)
                    ref.backward(g)
                    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
                    tol = 1e-6 if dtype == torch.float32 else 1e-2
                    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
                    torch.testing.assert_close(x.grad.float(), ref_x.grad.chunk(tp, -1)[topo.tp_rank],
                                               rtol=tol, atol=tol)
                    assert ref_x.grad[..., K:].abs().max() == 0
                    out.append((tp, padded, eps))
    return out


def test_vocab_parallel_cross_entropy():
    results = run_distributed(_check, 4)
    assert len(results[0]) == 3 * 2 * 2 * 2  # TP x padded x smoothing x dtype
