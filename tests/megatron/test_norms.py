"""--log-params-norm / --log-num-zeros-in-grad partial sums (megazero/zero/norms.py): by hand on
fake regions, and on the real GPT under TP x PP x DP = 2 x 2 x 2 (tied embeddings) and at ZeRO
0/1/3, summed over the optimizer's norm group, against the single-process model."""

from types import SimpleNamespace

import pytest
import torch

from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from megazero.zero.norms import count_zeros, params_sq, params_sum_of_squares
from tests.zero.gpt_helpers import CFG, args_for, gpt_batches, gpt_reference

M = 2


def test_counted_segments_and_fp16_rounding_by_hand():
    """Segments [0, 2) and [3, 5) of [3, 4, 100, 2049, 0.5]: 9 + 16 + 2049^2 + 0.25; as fp16 weights
    2049 is 2048 (fp16 spacing is 2 there; 2049^2 - 2048^2 = 4097), Megatron's param.data."""
    r = SimpleNamespace(master=torch.tensor([3.0, 4.0, 100.0, 2049.0, 0.5]), norm_segments=[(0, 2), (3, 5)])
    exact = pytest.approx(9 + 16 + 2049.0 ** 2 + 0.25, rel=1e-7)  # |w|^2 read back from fp32: 1e-7 relative
    assert params_sum_of_squares([r], torch.float32).item() == exact
    assert params_sum_of_squares([r], torch.bfloat16).item() == exact  # the fp32 master
    assert params_sum_of_squares([r], torch.float16).item() == pytest.approx(9 + 16 + 2048.0 ** 2 + 0.25, rel=1e-7)
    assert params_sum_of_squares([], torch.float32).item() == 0.0
    g = torch.tensor([0.0, 1.0, 0.0, -0.0, 2.0, 0.0])
    assert count_zeros([g[:3], g[3:5]]).item() == 3 and count_zeros([]).item() == 0  # -0.0 is a zero too


def _run(rank, world, layouts, data):
    from megazero.config.optimizer import OptimizerConfig
    from megazero.model import GPTConfig
    from megazero.model.stages import gpt_forward_step, gpt_stages
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    out = []
    for tp, pp, stage, tied in layouts:
        topo = Topology(world, rank, tp=tp, pp=pp).create_groups()
        stages = gpt_stages(GPTConfig(**CFG, untie_embeddings_and_output_weights=not tied), topo, 2)
        opt = ZeroOptimizer(stages.chunks, topo, **OptimizerConfig.from_args(args_for(stage, M)).kwargs(),
                            shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params)
        runner = PipelineRunner(topo, M, stages.activation_shape, stages.activation_dtype)
        runner.run(stages.chunks, data[topo.dp][0][topo.dp_rank], gpt_forward_step, grad_scale=opt.loss_scale)
        opt.finish_grad_sync()
        zeros = count_zeros([r.grad32()[a:b] for r in opt.regions for a, b in r.norm_segments]).float().reshape(1)
        opt.step()
        sq, sq_world = params_sq(opt), params_sq(opt, over_world=True)
        group = "mp" if stage == 0 else "world"  # ZeroOptimizer's norm group
        for t in (zeros, sq):
            opt.comm.all_reduce(t, group, async_op=False)
        opt.comm.all_reduce(sq_world, "world", async_op=False)
        assert sq_world.item() == sq.item()
        out.append(((tp, pp, stage, tied), zeros.item(), sq.item()))
        opt.close()
    return out


def _reference(data, tied):
    """(exact zeros, zeros or |g| < 1e-7, params sum of squares after the step) of the one-process GPT."""
    from megazero.model import GPTConfig, GPTModel
    model = GPTModel(GPTConfig(**CFG, untie_embeddings_and_output_weights=not tied))
    mbs = [mb for rank in data[0] for mb in rank]
    for mb in mbs:
        (model(mb["tokens"], labels=mb["labels"]).mean() / len(mbs)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    after = gpt_reference(data, tied=tied)
    return (grads == 0).sum().item(), (grads.abs() < 1e-7).sum().item(), sum(v.double().square().sum().item()
                                                                              for v in after.values())


def _check(results, data):
    refs = {tied: _reference(data, tied) for tied in (False, True)}
    assert refs[False][0] > 0  # untied: tokens absent from the batch get no embedding gradient
    for res in results:
        for layout, zeros, got in res:
            exact, loose, sq = refs[layout[3]]
            assert exact <= zeros <= loose, (layout, zeros, exact, loose)
            assert abs(got - sq) <= 1e-5 * sq, (layout, got, sq)


def test_tp2_pp2_dp2_tied_and_untied():
    data = {2: gpt_batches(1, 2, M)}
    results = run_distributed(_run, 8, [(2, 2, 1, True), (2, 2, 1, False)], data)
    _check(results, data[2])


def test_zero_stages_dp2_tp2():
    data = {2: gpt_batches(1, 2, M)}
    results = run_distributed(_run, 4, [(2, 1, 0, False), (2, 1, 1, False), (2, 1, 3, True)], data)
    _check(results, data[2])
