"""The ring's working memory follows the sequence, not its square: a CP rank's forward and backward
of one attention call add a few ``[b, H, s / CP, d]`` tensors to its resident set, not the
``b H L^2`` fp32 score blocks (``L = s / 2CP``) an explicit block computation forms (16 MiB here).

Measured as bench/context_parallel.py does (Linux): in a fresh forked rank, glibc's mmap threshold
at 1 MiB (freed tensors leave the resident set), the kernel's peak reset before the second of two
calls (the first pages in code and thread pools), ``ru_maxrss`` after it."""

from __future__ import annotations

import os
import resource
import sys

import pytest
import torch

from megazero.context_parallel.ring import ring_attention
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed

B, H, G, S, D = 1, 4, 2, 4096, 16  # CP 2: L = 1024, one score block b H L^2 4 = 16 MiB
MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_worker(rank, world):
    from megazero.zero.host_memory import return_freed_memory
    return_freed_memory(1 << 20)
    torch.set_num_threads(1)
    topo = Topology(world, rank, cp=world).create_groups()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, n, S // world, D, generator=g).requires_grad_() for n in (H, G, G))
    do = torch.randn(B, H, S // world, D, generator=g)
    for _ in range(2):
        before = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ring_attention(q, k, v, topo.group("cp"), topo.rank_lists["cp"]).backward(do)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        q.grad = k.grad = v.grad = None
    return peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident-set peaks from /proc (Linux)")
def test_ring_attention_adds_no_score_block():
    """Bound: half a score block (8 MiB); the rank's own q, k, v, o, do and gradients are 0.5 MiB each."""
    block = B * H * (S // 4) ** 2 * 4
    peaks = run_distributed(_peak_worker, 2)
    assert max(peaks) < block // 2, [p / MiB for p in peaks]
