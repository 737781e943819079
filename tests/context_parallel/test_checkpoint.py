"""CP shards no parameter: a run saved at CP 2 resumes at CP 1 (DP 2) or CP 4 (ZeRO re-partitioned
over the new DP x CP) with the losses of the uninterrupted run; the same CP resumes bit for bit."""

from __future__ import annotations

import torch

from megazero.checkpoint import schema
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.context_parallel.test_equivalence import MB, _config
from tests.zero.gpt_helpers import args_for

STEPS, TOTAL_MB = 4, 4


class Run:
    def __init__(self, topo, stage: int):
        from megazero.config.optimizer import OptimizerConfig
        from megazero.model.stages import gpt_stages
        from megazero.pipeline import PipelineRunner
        from megazero.zero import ZeroOptimizer
        self.topo, self.stage, self.M = topo, stage, TOTAL_MB // topo.dp
        self.config = _config()
        self.stages = gpt_stages(self.config, topo, MB)
        self.opt = ZeroOptimizer(self.stages.chunks, topo, **OptimizerConfig.from_args(args_for(stage, self.M)).kwargs(),
                                 shared_params=self.stages.shared_params,
                                 tp_duplicated_params=self.stages.tp_duplicated_params)
        self.runner = PipelineRunner(topo, self.M, self.stages.activation_shape, self.stages.activation_dtype)
        self.iteration = 0

    def layout(self):
        t = self.topo
        return schema.layout(t.world_size, t.tp, t.pp, None, t.dp, self.stage, torch.float32, cp=t.cp)

    def train(self, steps):
        import torch.distributed as dist
        losses, t = [], self.topo
        for mbs in steps:
            out = self.runner.run(self.stages.chunks, mbs[t.dp_rank * self.M:(t.dp_rank + 1) * self.M],
                                  self.stages.forward_step, grad_scale=self.opt.loss_scale)
            assert self.opt.step()[0]
            self.iteration += 1
            mean = torch.stack(out).mean().reshape(1)
            dist.all_reduce(mean, group=t.dp_cp_group)
            losses.append(mean.item() / t.dp_cp)
        return losses

    def save(self, root):
        from megazero.checkpoint.api import save_run
        save_run(root, topo=self.topo, stages=self.stages, optimizer=self.opt, scheduler_state=None,
                 counters={"skipped": 0, "nans": 0}, iteration=self.iteration, consumed_samples=0,
                 layout=self.layout(), saved_args=self.config.to_args(self.topo.tp))

    def load(self, root):
        from megazero.checkpoint.api import load_run
        return load_run(root, topo=self.topo, stages=self.stages, optimizer=self.opt, layout=self.layout(),
                        model_config=self.config, device=torch.device("cpu")).path


def _data():
    """STEPS steps of TOTAL_MB micro-batches (the whole global batch; each DP rank takes its M)."""
    g = torch.Generator().manual_seed(9)
    rand = lambda: torch.randint(0, 40, (MB, 16), generator=g)  # noqa: E731
    return [[{"tokens": rand(), "labels": rand()} for _ in range(TOTAL_MB)] for _ in range(STEPS)]


def _job(rank, world, sizes, stage, tmp, mode):
    torch.set_num_threads(1)
    topo = Topology(world, rank, **sizes).create_groups()
    data, run = _data(), Run(topo, stage)
    if mode == "save":
        first = run.train(data[:2])
        run.save(tmp)
        return first + run.train(data[2:])  # the uninterrupted run's losses
    path = run.load(tmp)
    return path, run.train(data[2:])


def test_saved_at_cp2_resumes_at_cp1_cp2_and_cp4(tmp_path):
    straight = run_distributed(_job, 2, dict(cp=2), 1, str(tmp_path / "a"), "save")[0]
    for world, sizes, exact in ((2, dict(cp=2), True), (2, dict(), False), (4, dict(cp=4), False)):
        path, losses = run_distributed(_job, world, sizes, 1, str(tmp_path / "a"), "load")[0]
        assert (path == "exact") == exact, (sizes, path)
        tol = 0.0 if exact else 1e-5
        assert max(abs(a - b) for a, b in zip(losses, straight[2:])) <= tol, (sizes, losses, straight[2:])
