"""The runner on forked gloo ranks with the toy model: equivalence with one process, memory,
loss scaling, evaluation, traces, tied-copy sync over many steps, and failure without hangs."""

import json
import time

import pytest
import torch

from megazero.pipeline import (ScheduleTrace, allreduce_shared_grads, forward_backward, in_flight_bound,
                               write_pipeline_trace)
from megazero.testing import RankFailure
from megazero.parallel.topology import Topology

from .toy import launch, reference, rel_err, toy_batches, toy_chunks, toy_shared, toy_step

V, H, L, B, S = 16, 8, 24, 2, 4
# (tp, pp, vp, m, tied): run on 8 ranks (the rest of the world is data-parallel replicas).
LAYOUTS = [(1, 1, 1, 3, True), (1, 2, 1, 2, True), (1, 2, 1, 6, False), (1, 2, 2, 4, True), (1, 2, 3, 2, False),
           (1, 4, 1, 8, True), (1, 4, 2, 4, False), (1, 4, 2, 8, True), (2, 4, 3, 4, True), (2, 2, 2, 6, False)]


def _equivalence(rank, world, path):
    out = []
    for tp, pp, vp, m, tied in LAYOUTS:
        topo = Topology(world, rank, tp=tp, pp=pp, vp=vp).create_groups()
        batches = toy_batches(m, B, S, V, seed=m)
        ref_losses, ref_grads = reference(V, H, L, tied, batches)
        chunks = toy_chunks(V, H, L, pp, vp, topo.pp_rank, tied)
        sent = []

        def step(chunk, mb, x):
            y = toy_step(chunk, mb, x)
            if not chunk.post_process:
                sent.append(y)
            return y

        stats = {}
        scale = torch.tensor(4.0) if vp == 2 else 1.0
        losses = forward_backward(chunks, batches, topo, step, (S, B, H), torch.float32, grad_scale=scale, stats=stats)
        allreduce_shared_grads(toy_shared(chunks, topo))
        errs = {}
        if topo.is_last_stage:
            errs["loss"] = rel_err(torch.stack(losses), ref_losses)
        else:
            assert losses == []
        for chunk in chunks:
            for name, g in chunk.named_grads().items():
                errs[name] = rel_err(g / float(scale), ref_grads[name])
        assert stats["max_in_flight"] <= in_flight_bound(pp, vp, m, topo.pp_rank)
        if vp == 1:
            assert stats["max_in_flight"] <= pp
        assert all(t.numel() == 1 for t in sent), "sent activations must be freed"
        # evaluation: same losses, no gradients touched
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        eval_losses = forward_backward(chunks, batches, topo, toy_step, (S, B, H), torch.float32, forward_only=True)
        if topo.is_last_stage:
            errs["eval_loss"] = rel_err(torch.stack(eval_losses), ref_losses)
        assert all(p.grad is None for c in chunks for p in c.parameters())
        out.append(((tp, pp, vp, m, tied), errs, stats["schedule"]))
    # one traced step, written by rank 0
    topo = Topology(world, rank, tp=1, pp=4, vp=2).create_groups()
    trace = ScheduleTrace()
    forward_backward(toy_chunks(V, H, L, 4, 2, topo.pp_rank, True), toy_batches(8, B, S, V), topo, toy_step,
                     (S, B, H), torch.float32, trace=trace)
    rep = write_pipeline_trace(path, trace, print_fn=None)
    return out, rep


def test_pipeline_equals_single_process(tmp_path):
    path = str(tmp_path / "trace.json")
    results = launch(_equivalence, 8, path, timeout_s=100)
    for rank, (out, rep) in enumerate(results):
        for layout, errs, _ in out:
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad, f"rank {rank} layout (tp, pp, vp, m, tied)={layout}: {bad}"
    names = {s for _, _, s in results[0][0]}
    assert names == {"no-pipelining", "1f1b", "interleaved-1f1b"}
    rep = results[0][1]
    assert rep is not None and all(r[1] is None for r in results[1:])
    assert rep["bubble_theory"] == pytest.approx(3 / 16) and len(rep["bubble_per_rank"]) == 8
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"forward", "backward", "wait"}
    assert sum(e["cat"] == "forward" and e["pid"] == 0 for e in spans) == 16  # M x VP on rank 0
    assert {e["pid"] for e in spans} == set(range(8))


def _tied_training(rank, world):
    topo = Topology(world, rank, tp=1, pp=4, vp=2).create_groups()
    out = {}
    for opt_name in ("sgd", "adamw"):
        chunks = toy_chunks(V, H, 16, 4, 2, topo.pp_rank, True)
        params = [p for c in chunks for p in c.parameters()]
        opt = torch.optim.AdamW(params, lr=0.05) if opt_name == "adamw" else torch.optim.SGD(params, lr=0.5)
        for it in range(20):
            opt.zero_grad(set_to_none=True)
            forward_backward(chunks, toy_batches(4, B, S, V, seed=it), topo, toy_step, (S, B, H), torch.float32)
            allreduce_shared_grads(toy_shared(chunks, topo))
            opt.step()
        w = chunks[0].shared_embedding_weight() if topo.is_first_stage else chunks[-1].shared_embedding_weight()
        out[opt_name] = None if w is None else w.detach().clone()
    return out


def test_tied_copies_stay_bit_equal_after_20_steps():
    first, *_, last = launch(_tied_training, 4, timeout_s=60)
    for opt_name in ("sgd", "adamw"):
        assert torch.equal(first[opt_name], last[opt_name]), opt_name
        assert not torch.equal(first[opt_name], toy_chunks(V, H, 16, 4, 2, 0, True)[0].embed.detach())  # trained


def _raises_on_rank(rank, world, bad_rank):
    topo = Topology(world, rank, tp=1, pp=4, vp=1).create_groups()

    def step(chunk, mb, x):
        if rank == bad_rank and mb is batches[1]:
            raise ValueError(f"boom on rank {rank}")
        return toy_step(chunk, mb, x)

    batches = toy_batches(8, B, S, V)
    forward_backward(toy_chunks(V, H, 8, 4, 1, topo.pp_rank, True), batches, topo, step, (S, B, H), torch.float32)


def test_failing_rank_is_named_and_nothing_hangs():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_raises_on_rank, 4, 2, timeout_s=40, grace_s=15, collective_timeout_s=8)
    msg = str(info.value)
    assert "first: rank 2" in msg and "boom on rank 2" in msg
    assert time.monotonic() - t0 < 30
