"""MoE checkpoints (format 4): routed experts live on the expert grid (one EP rank, split over
expert TP, replicated or sharded over expert DP) and the router's expert bias is training state.

* the same layout resumes bit for bit (losses, weights, fp32 masters and moments, expert bias)
  at ZeRO 0 (expert replicas written by expert-DP rank 0), 1 and 3 (expert shards over expert DP);
* a chain EP 4 -> EP 2 x TP 2 x ETP 1 (ZeRO 3) -> EP 1 x PP 2 (ZeRO 0) -> EP 2 x TP 2 x ETP 2
  (ZeRO 2) loads the same full model (every kind bit-equal, and the live model's full state
  gathered across EP equal to it), and the next steps' losses equal the uninterrupted run's.

A tiny DeepSeek-style MoE (sigmoid router with expert bias, a shared expert with its gate, a
dense layer among MoE ones), fp32, 4 micro-batches per step split over the DP ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from megazero.checkpoint import schema
from megazero.checkpoint.reader import KINDS, CheckpointReader
from megazero.testing import run_distributed
from tests.moe.helpers import MB, args_for, gpt_batches, moe_config

OVERRIDES = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=0.01, moe_shared_expert_intermediate_size=8,
                 moe_shared_expert_gate=True, moe_layer_freq="[1,0,1,1]")
TOTAL_MB = 4  # micro-batches per step over all DP ranks
BIAS = [f"layers.{n}.mlp.router.expert_bias" for n in (0, 2, 3)]


class Run:
    """This rank's MoE GPT stages, ZeRO optimizer and pipeline runner for one layout."""

    def __init__(self, topo, stage: int, sp: bool):
        from megazero.config.optimizer import OptimizerConfig
        from megazero.model.stages import gpt_stages
        from megazero.pipeline import PipelineRunner
        from megazero.zero import ZeroOptimizer
        self.topo, self.stage, self.M = topo, stage, TOTAL_MB // topo.dp
        self.config = moe_config(**OVERRIDES, sequence_parallel=sp)
        self.stages = gpt_stages(self.config, topo, MB)
        self.opt = ZeroOptimizer(self.stages.chunks, topo, **OptimizerConfig.from_args(args_for(stage, self.M)).kwargs(),
                                 shared_params=self.stages.shared_params,
                                 tp_duplicated_params=self.stages.tp_duplicated_params,
                                 expert_params=self.stages.expert_params)
        self.runner = PipelineRunner(topo, self.M, self.stages.activation_shape, self.stages.activation_dtype)
        self.iteration = 0

    def layout(self) -> dict:
        t = self.topo
        return schema.layout(t.world_size, t.tp, t.pp, None, t.dp, self.stage, torch.float32, ep=t.ep, etp=t.etp)

    def train(self, steps) -> list[float]:
        """One step per entry of ``steps`` (each the step's TOTAL_MB micro-batches); the DP-mean
        losses on the last stage, else []."""
        import torch.distributed as dist
        losses, t = [], self.topo
        for mbs in steps:
            mine = mbs[t.dp_rank * self.M:(t.dp_rank + 1) * self.M]
            self.stages.moe.set_aux_scale(self.opt.loss_scale / self.M)
            out = self.runner.run(self.stages.chunks, mine, self.stages.forward_step, grad_scale=self.opt.loss_scale)
            self.stages.moe.update_expert_bias(self.config.moe.bias_update_rate)
            ok, _ = self.opt.step()
            assert ok
            self.iteration += 1
            if t.is_last_stage:
                mean = torch.stack(out).mean().reshape(1)
                dist.all_reduce(mean, group=t.dp_group)
                losses.append(mean.item() / t.dp)
        return losses

    def save(self, root: str) -> None:
        from megazero.checkpoint.api import save_run
        save_run(root, topo=self.topo, stages=self.stages, optimizer=self.opt, scheduler_state=None,
                 counters={"skipped": 0, "nans": 0}, iteration=self.iteration, consumed_samples=0,
                 layout=self.layout(), saved_args=self.config.to_args(self.topo.tp))

    def load(self, root: str) -> str:
        from megazero.checkpoint.api import load_run
        loaded = load_run(root, topo=self.topo, stages=self.stages, optimizer=self.opt, layout=self.layout(),
                          model_config=self.config, device=torch.device("cpu"))
        self.iteration = loaded.iteration
        return loaded.path

    def full_state(self) -> dict:
        """This rank's full tensors (its EP rank's experts) and buffers."""
        with self.opt.gathered_params():
            out = {k: v.clone() for c in self.stages.chunks for k, v in c.full_state_dict().items()}
        for c in self.stages.chunks:
            out.update({f"{n}": b.clone() for n, b in c.named_buffers() if n.endswith("expert_bias")})
        return out


def steps_data(n: int, seed: int = 3) -> list[list[dict]]:
    return [step[0] for step in gpt_batches(n, 1, TOTAL_MB, seed=seed)]


def _topo(rank, world, sizes):
    from megazero.parallel.topology import Topology
    torch.set_num_threads(1)
    return Topology(world, rank, **sizes).create_groups()


def _exact(rank, world, sizes, stages, tmp):
    """Per ZeRO stage: 4 steps straight; 2 steps, save, a fresh model loads (the exact path),
    saves again at once, 2 steps. Returns per stage (straight, resumed, path, final states)."""
    topo, data, out = _topo(rank, world, sizes), steps_data(4), []
    for stage in stages:
        straight = Run(topo, stage, sp=topo.tp > 1)
        ref = straight.train(data)
        first = Run(topo, stage, sp=topo.tp > 1)
        first.train(data[:2])
        first.save(f"{tmp}/z{stage}/a")
        second = Run(topo, stage, sp=topo.tp > 1)
        path = second.load(f"{tmp}/z{stage}/a")
        second.save(f"{tmp}/z{stage}/b")
        resumed = second.train(data[2:])
        out.append((ref[2:], resumed, path, straight.full_state(), second.full_state()))
    return out


def assert_same_checkpoint(a: CheckpointReader, b: CheckpointReader) -> None:
    assert a.param_names() == b.param_names()
    for name in a.param_names():
        for kind in KINDS:
            x, y = a.full_param(name, kind), b.full_param(name, kind)
            assert x.shape == y.shape and torch.equal(x, y), f"{name} {kind}: max diff {(x - y).abs().max()}"
    for name in BIAS:
        assert torch.equal(a.full_param(name), b.full_param(name)), name
    assert a.optimizer_counters()["iteration"] == b.optimizer_counters()["iteration"]


def test_same_layout_resumes_bit_exactly(tmp_path):
    """EP 2 x DP 4 at ZeRO 0, 1 and 3: expert-DP rank 0 writes each expert's replica (ZeRO 0),
    the others read it from there; ZeRO 3 writes expert shards over expert DP."""
    stages = (0, 1, 3)
    results = run_distributed(_exact, 4, dict(ep=2), stages, str(tmp_path), timeout_s=300)
    for s, stage in enumerate(stages):
        last = results[-1][s]
        assert last[2] == "exact" and last[0] == last[1], (stage, last[:3])
        for r in results:
            assert r[s][3].keys() == r[s][4].keys()
            for name in r[s][3]:
                assert torch.equal(r[s][3][name], r[s][4][name]), (stage, name)
        a, b = (CheckpointReader(str(tmp_path / f"z{stage}" / x)) for x in "ab")
        assert a.version == 4 and {e["ep_rank"] for e in a.ranks} == {0, 1}
        assert any(n.startswith("layers.0.mlp.experts.3.") for n in a.param_names())
        assert_same_checkpoint(a, b)
        assert a.full_param(BIAS[0]).abs().sum() > 0  # the expert bias moved and was saved


def _hop(rank, world, sizes, stage, src, dst, n_after):
    """Load ``src`` into this layout, save it to ``dst`` at once, report the live full state,
    then train ``n_after`` steps (the uninterrupted run's next ones)."""
    topo = _topo(rank, world, sizes)
    run = Run(topo, stage, sp=topo.tp > 1)
    if src is None:  # the reference: 2 steps, save, 2 more
        run.train(steps_data(2))
        run.save(dst)
        return run.train(steps_data(4)[2:]), None, None
    path = run.load(src)
    run.save(dst)
    state = run.full_state()
    return run.train(steps_data(4)[2:2 + n_after]), state, path


def _launch(world, sizes, stage, src, dst, n_after=2):
    return run_distributed(_hop, world, sizes, stage, src, dst, n_after, timeout_s=300)


def test_reshard_across_ep_tp_pp_etp(tmp_path):
    ref = _launch(4, dict(ep=4), 1, None, str(tmp_path / "ep4"))
    ref_losses = next(r[0] for r in ref if r[0])
    first = CheckpointReader(str(tmp_path / "ep4"))
    assert first.layout["expert_model_parallel_size"] == 4
    chain = [("ep2_tp2_etp1", 4, dict(tp=2, ep=2, etp=1), 3), ("ep1_pp2", 2, dict(pp=2), 0),
             ("ep2_tp2_etp2", 4, dict(tp=2, ep=2), 2)]
    src = str(tmp_path / "ep4")
    for name, world, sizes, stage in chain:
        dst = str(tmp_path / name)
        results = _launch(world, sizes, stage, src, dst)
        assert all(r[2] == "resharded" for r in results)
        losses = next(r[0] for r in results if r[0])
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
        live = {}
        for r in results:
            live.update(r[1])
        for p in first.param_names() + BIAS:  # the live model, gathered across EP: the saved model
            want = first.full_param(p)
            assert torch.equal(live[p], want), (name, p, (live[p] - want).abs().max())
        loaded = CheckpointReader(dst)
        assert loaded.layout["expert_tensor_parallel_size"] == sizes.get("etp", sizes.get("tp", 1))
        assert_same_checkpoint(first, loaded)
        src = dst
