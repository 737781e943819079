"""ZeRO 3 under zero-bubble plans holds what it holds under 1F1B: a unit is released at the end of
its B (its inputs have their gradients), and the plan's W, which computes ``dW = G^T X`` from the
saved input and output gradient, runs on the released (sharded) parameters; its gradients still
reach the regions' hooks, which reduce them, at W. Counted on the gatherer's bookkeeping (the
gathered elements, ``ParamGatherer.live``) and on the regions' storage itself, per action, at
PP 2 x DP 2 and PP 4, under zb-h1, interleaved-zb, zbv and dualpipev: at no point does a rank
hold more than its shards plus its chunk's root unit, the layer unit in use and the prefetched
ones; after every B no layer unit is left gathered (without prefetch), while under the old
release (when a unit's gradients were complete) every layer of a zb-h1 stage stayed gathered
until its W. Exactness is tests/pipeline/test_zero_bubble.py's."""

from __future__ import annotations

import math

import pytest
import torch

from megazero.parallel.topology import Topology

from .toy import launch

SEQ, MB = 8, 2
VP = {"1f1b": 1, "zb-h1": 1, "zbv": 2, "interleaved-zb": 2, "dualpipev": 2}
CFG = dict(num_layers=8, hidden_size=16, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
           max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4,
           position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False,
           untie_embeddings_and_output_weights=True)
EXTRA = {"": {}, "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
         "moe": dict(num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2, moe_layer_freq="[1,0,1,0,1,1,0,1]")}


def _batches(m, dp_rank):
    g = torch.Generator().manual_seed(11 + dp_rank)
    ids = lambda: torch.randint(0, 40, (MB, SEQ), generator=g)  # noqa: E731
    return [{"tokens": ids(), "labels": ids()} for _ in range(m)]


class _Probe:
    """A runner trace that, after each action, compares the regions' gathered storage with the
    gatherer's count and records the layer units left gathered after each B and W."""

    def __init__(self, gatherer):
        self.gatherer, self.after_b, self.mismatch = gatherer, [], []

    def begin(self, topo, schedule, m, vp):
        pass

    def record(self, action, start, end):
        units = self.gatherer.units
        stored = sum(u.region.param_flat.untyped_storage().nbytes() // u.region.param_flat.element_size()
                     for u in units)
        if stored != self.gatherer.live:
            self.mismatch.append((str(action), stored, self.gatherer.live))
        if action.kind in ("B", "W"):
            self.after_b.append(sum(1 for u in units if not u.root and u.region.gathered))


def _bound(units, prefetch: int) -> int:
    """Per chunk: its root unit + the layer in use + the layers a prefetch of ``prefetch``
    elements starts (units are added while fewer than ``prefetch`` elements were counted);
    the rank's bound is the largest chunk's (one chunk runs at a time)."""
    out = 0
    for c in {u[1] for u in units}:
        root = sum(n for r, ch, n in units if r and ch == c)
        layers = sorted((n for r, ch, n in units if not r and ch == c), reverse=True)
        extra = 0 if prefetch <= 0 else min(len(layers) - 1, math.ceil(prefetch / max(layers, default=1)))
        out = max(out, root + sum(layers[:1 + extra]))
    return out


def _peaks(rank, world, cases):
    from megazero.config.optimizer import OptimizerConfig
    from megazero.model.config import GPTConfig
    from megazero.model.stages import gpt_stages
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    from tests.zero.gpt_helpers import args_for
    out = []
    for pp, schedule, prefetch, extra in cases:
        m = 2 * pp
        topo = Topology(world, rank, pp=pp, vp=VP[schedule], ep=2 if extra == "moe" else 1,
                        pipeline_schedule=None if schedule == "1f1b" else schedule).create_groups()
        config = GPTConfig.from_megatron(dict(CFG, params_dtype=torch.float32, **EXTRA[extra]), vocab_size=40)
        stages = gpt_stages(config, topo, MB)
        args = args_for(3, m, clip_grad=1.0, zero_prefetch_bucket_size=prefetch, params_dtype=stages.activation_dtype)
        opt = ZeroOptimizer(stages.chunks, topo, **OptimizerConfig.from_args(args).kwargs(),
                            shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params,
                            expert_params=stages.expert_params)
        runner = PipelineRunner(topo, m, stages.activation_shape, stages.activation_dtype)
        probe, peaks = _Probe(opt.gatherer), []
        for step in range(2):  # the first step records the execution order; the second prefetches
            opt.gatherer.peak_live = 0
            for u in opt.gatherer.units:
                u.gathers = 0
            runner.run(stages.chunks, _batches(m, topo.dp_rank), stages.forward_step, grad_scale=opt.loss_scale,
                       weight_grad_stores=stages.weight_grad_stores, trace=probe if step else None)
            peaks.append(opt.gatherer.peak_live)
            assert opt.step()[0]
        units = [(u.root, u.chunk, u.region.padded) for u in opt.gatherer.units]
        first = [u.gathers for u in opt.gatherer.units if u.root and stages.chunks[u.chunk].pre_process
                 and not stages.chunks[u.chunk].post_process]  # a first stage's embedding root
        out.append(dict(peaks=peaks, units=units, after_b=probe.after_b, mismatch=probe.mismatch, m=m,
                        embedding_root_gathers=first))
    return out


CASES = ([(2, s, p, "") for s in VP for p in (0, 5000)] + [(4, s, 0, "") for s in VP]
         + [(2, s, 0, x) for x in ("recompute", "moe") for s in ("1f1b", "zb-h1")])


@pytest.fixture(scope="module")
def measured():
    return launch(_peaks, 4, CASES, timeout_s=240)


NAMES = [f"pp{pp}-{s}-prefetch{p}" + (f"-{x}" if x else "") for pp, s, p, x in CASES]


@pytest.mark.parametrize("i", range(len(CASES)), ids=NAMES)
def test_gathered_parameters_bounded_as_under_1f1b(measured, i):
    """Dense: the bound of :func:`_bound`; MoE (an expert unit in use inside its layer's) and
    recompute: zb-h1 as 1F1B. Without prefetch, nothing of a layer is left gathered after B or W."""
    pp, schedule, prefetch, extra = CASES[i]
    for rank, res in enumerate(measured):
        got = res[i]
        assert not got["mismatch"], (rank, got["mismatch"][:3])  # storage == the gatherer's count
        if extra != "moe":
            assert max(got["peaks"]) <= _bound(got["units"], prefetch), (rank, got["peaks"], got["units"])
        if prefetch == 0:  # B released every layer it gathered; W gathered none
            assert not any(got["after_b"]), (rank, got["after_b"])
        if schedule == "zb-h1":  # the same stages as 1F1B: the same peak, step by step
            same = CASES.index((pp, "1f1b", prefetch, extra))
            assert got["peaks"] == res[same]["peaks"], (rank, got["peaks"], res[same]["peaks"])


def test_a_first_stage_embedding_root_is_gathered_for_its_forward_only(measured):
    """A first stage's root unit (the embedding: its backward, ``dW[ids] += G``, reads no weight)
    is all-gathered once per micro-batch, for the forward -- not again for its backward (it was:
    2 M per step, and held through the stage's layers' backward). Without prefetch, every
    schedule."""
    seen = 0
    for i, (pp, schedule, prefetch, extra) in enumerate(CASES):
        for res in measured:
            if prefetch == 0 and res[i]["embedding_root_gathers"]:
                assert res[i]["embedding_root_gathers"] == [res[i]["m"]], (CASES[i], res[i]["embedding_root_gathers"])
                seen += 1
    assert seen >= len(VP)
