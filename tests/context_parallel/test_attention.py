"""Ring (p2p) and all-to-all attention over CP ranks equal one process's causal attention,
forward and backward, with GQA; the load-balanced chunk layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.context_parallel.chunks import chunk_ids, positions_for_rank, slice_for_rank
from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed


def _inputs(H=4, G=2, s=16, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, s, d, generator=g, dtype=torch.float64) for n in (H, G, G)] + \
        [torch.randn(2, H, s, d, generator=g, dtype=torch.float64)]


def _reference(window=None):
    q, k, v, do = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # keys j with i - window <= j <= i, built here independently of megazero's mask
        i, j = torch.arange(16).unsqueeze(1), torch.arange(16).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j >= i - window), enable_gqa=True)
    out.backward(do)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def _cp_worker(rank, world, kind, tile_elems=None, window=None):
    topo = Topology(world, rank, cp=world).create_groups()
    q, k, v, do = (slice_for_rank(t, 2, world, rank) for t in _inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if kind in ("p2p", "explicit"):  # the fused block kernel (CPU flash), or the explicit tiles
        extra = {"tile_elems": tile_elems} if tile_elems else {}
        out = ring_attention(q, k, v, topo.group("cp"), topo.rank_lists["cp"], fused=kind == "p2p",
                             window=window, **extra)
    else:
        out = ulysses_attention(q, k, v, topo.group("cp"), world, enable_gqa=True, window=window)
    out.backward(do)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("cp,kind,tile", [(2, "p2p", None), (4, "p2p", None), (2, "a2a", None), (4, "explicit", None),
                                          (2, "explicit", 24)])
def test_cp_attention_equals_full_causal_attention(cp, kind, tile):
    """``p2p``: the fused block kernel; ``explicit``: the fallback, with ``tile`` 24 score
    elements, less than one query row (b H L = 32): one row per tile."""
    ref = _reference()
    for rank, got in enumerate(run_distributed(_cp_worker, cp, kind, tile)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, slice_for_rank(b, 2, cp, rank), rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("cp,kind,window", [(2, "p2p", 0), (2, "p2p", 2), (2, "p2p", 5), (4, "p2p", 3),
                                            (2, "a2a", 2), (2, "a2a", 6), (2, "p2p", 15)])
def test_cp_sliding_window_equals_one_process(cp, kind, window):
    """``--window-size (window, 0)`` under CP: query ``i`` sees keys ``i - window .. i``; windows
    shorter than a chunk (L = 16 / 2CP) leave whole blocks and rows of a block with no key."""
    ref = _reference(window)
    for rank, got in enumerate(run_distributed(_cp_worker, cp, kind, None, window)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, slice_for_rank(b, 2, cp, rank), rtol=1e-9, atol=1e-10, msg=name)


def test_load_balanced_layout():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    t = torch.arange(16)
    assert slice_for_rank(t, 0, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions_for_rank(8, 2, 0, "cpu").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="not divisible by 2 x CP = 4"):
        slice_for_rank(torch.arange(6), 0, 2, 0)
