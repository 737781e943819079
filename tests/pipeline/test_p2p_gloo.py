"""The communicator's NCCL posting run on gloo (there is no backend branch: NCCL gets the same
calls): every schedule at PP 4 (4 channel classes) and PP 3 (6, the wrap pair coloured apart)
equals one process under a short collective timeout, on a backend whose sends -- like NCCL's
-- complete only when the receive is posted (checked here, not assumed); each exchange posts the
next one's receives ahead, and none is left after a step."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import torch

from megazero.parallel.topology import Topology
from megazero.pipeline.streams import channel_classes

from .toy import launch, reference, rel_err, toy_batches, toy_chunks, toy_step

TIMEOUT = timedelta(seconds=10)  # every group's, the channel classes' too: a hang fails fast
SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


def _send_waits_for_receive(rank, world):
    import torch.distributed as dist
    t = torch.ones(1024)
    if rank == 0:
        start = time.perf_counter()
        dist.isend(t, 1).wait()
        return time.perf_counter() - start
    time.sleep(0.5)
    dist.irecv(t, 0).wait()
    return None


def test_gloo_send_completes_only_when_received():
    assert launch(_send_waits_for_receive, 2, timeout_s=30)[0] >= 0.4


class _AheadProbe:
    """A duck-typed trace: the most receives the communicator held posted ahead after a COMM."""

    def __init__(self, runner):
        self.runner, self.peak = runner, 0

    def begin(self, *args):
        pass

    def record(self, action, start, end):
        if action.kind == "COMM":
            self.peak = max(self.peak, self.runner.comm.receives_ahead)


def _schedules(rank, world, m):
    from megazero.parallel.layout import chunk_placement
    from megazero.pipeline import PipelineRunner
    out = {}
    for schedule, vp in SCHEDULES.items():
        topo = Topology(world, rank, pp=world, vp=vp, pipeline_schedule=schedule).create_groups(timeout=TIMEOUT)
        batches = toy_batches(m, 2, 4, 16, seed=5)
        ref_losses, ref_grads = reference(16, 8, 24, False, batches)
        chunks = toy_chunks(16, 8, 24, world, vp, topo.pp_rank, False, placement=chunk_placement(schedule))
        runner = PipelineRunner(topo, m, (4, 2, 8), torch.float32)
        probe = _AheadProbe(runner)
        losses = runner.run(chunks, batches, toy_step, trace=probe)
        errs = {"loss": rel_err(torch.stack(losses), ref_losses)} if topo.is_last_stage else {}
        errs.update({k: rel_err(g, ref_grads[k]) for c in chunks for k, g in c.named_grads().items()})
        evals = runner.run(chunks, batches, toy_step, forward_only=True)
        if topo.is_last_stage:
            errs["eval"] = rel_err(torch.stack(evals), ref_losses)
        out[schedule] = (errs, len(runner.comm.groups), runner.comm.sends_in_flight == 0,
                         (probe.peak, runner.comm.receives_ahead))
    return out


def _check(results, pp):
    for schedule in SCHEDULES:
        assert sum("loss" in r[schedule][0] for r in results) == 1
        for rank, r in enumerate(results):
            errs, groups, drained, (ahead, left) = r[schedule]
            assert groups == channel_classes(pp) and drained, (rank, schedule)
            assert ahead >= 1 and left == 0, (rank, schedule, ahead, left)  # receives posted a COMM ahead
            assert all(v <= 1e-5 for v in errs.values()), (rank, schedule, errs)


def test_every_schedule_on_the_nccl_posting_pp4():
    _check(launch(_schedules, 4, 8, timeout_s=60, collective_timeout_s=10), 4)


def test_every_schedule_on_the_nccl_posting_pp3_odd():
    _check(launch(_schedules, 3, 6, timeout_s=60, collective_timeout_s=10), 3)


def test_communicator_needs_the_topology_groups():
    from megazero.pipeline import P2PCommunicator
    with pytest.raises(RuntimeError, match="process groups not created"):
        P2PCommunicator(Topology(4, 0, pp=4), (4, 2, 8), torch.float32, "cpu")
    assert P2PCommunicator(Topology(1, 0), (4, 2, 8), torch.float32, "cpu").groups == ()
