"""megazero.planner for Mixture-of-Experts GPTs: expert parameter counts against built models (EP 1
and 2, expert TP, pipeline slices), expert states over the expert-DP group against the ZeRO
optimizer's buffers, the dispatcher and expert-gradient volumes, EP in the layouts, the command line."""

import json

import pytest
import torch

from megazero import planner as plan
from megazero.model import GPTConfig, GPTModel
from megazero.model.stages import expert_parallel_params
from megazero.parallel.topology import Topology
from megazero.pipeline import chunk_layer_ranges, chunk_roles
from megazero.planner.cli import main as planner_main

MOE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, make_vocab_size_divisible_by=4,
           add_bias_linear=False, swiglu=True, ffn_hidden_size=48, num_experts=4, moe_ffn_hidden_size=16,
           moe_router_topk=2, moe_layer_freq="[1,0,1,1]", attention_dropout=0.0, hidden_dropout=0.0)
VARIANTS = [
    {},
    dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True),
    dict(swiglu=False, normalization="RMSNorm", moe_layer_freq=2, untie_embeddings_and_output_weights=True,
         position_embedding_type="rope", num_query_groups=2),
]


def _shape(**kw) -> GPTConfig:
    return GPTConfig.from_megatron(dict(MOE, **kw), vocab_size=50)


def _counts(models) -> tuple[int, int]:
    """(all, routed-expert) parameters of these modules."""
    return (sum(p.numel() for m in models for p in m.parameters()),
            sum(p.numel() for p in expert_parallel_params(models)))


def _rank_counts(shape, topo, pp, vp, r):
    ranges, roles = chunk_layer_ranges(shape.num_layers, pp, vp, r), chunk_roles(pp, vp, r)
    return _counts([GPTModel(shape, topo, lo, hi, pre_process=first, post_process=last)
                    for (lo, hi), (first, last) in zip(ranges, roles)])


@pytest.mark.parametrize("kw", VARIANTS)
def test_moe_params_match_the_model_at_ep1(kw):
    """One process holds every expert: Φ and Φ_e equal the built model's, whole and per pipeline
    rank (VP chunks interleave the MoE layers of --moe-layer-freq)."""
    shape = _shape(**kw)
    model = GPTModel(shape)
    total, experts = _counts([model])
    assert plan.total_params(shape) == total and plan.stage_param_split(shape, 1, 1, 0)[1] == experts
    assert experts == shape.moe.num_moe_layers * 4 * (3 if shape.swiglu else 2) * 16 * 32  # E (u + f) h per layer
    for pp, vp in ((2, 1), (2, 2), (4, 1)):
        got = [_rank_counts(shape, None, pp, vp, r) for r in range(pp)]
        want = [(plan.stage_params(shape, 1, pp, r, vp), plan.stage_param_split(shape, 1, pp, r, vp)[1])
                for r in range(pp)]
        assert got == want, (kw, pp, vp)


def test_mixtral_8x7b_counts_equal_hugging_face():
    """Mixtral-8x7B: 46,702,792,704 parameters (the Hub checkpoint's), 12.9 B active per token."""
    shape = GPTConfig.from_megatron(dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                         ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
                                         position_embedding_type="rope", add_bias_linear=False,
                                         untie_embeddings_and_output_weights=True, num_experts=8,
                                         moe_router_topk=2, seq_length=4096), vocab_size=32000)
    assert plan.total_params(shape) == 46_702_792_704
    assert plan.active_params(shape) == 12_879_925_248


LAYOUTS = [dict(tp=1, ep=2), dict(tp=2, ep=1), dict(tp=2, ep=2, etp=1), dict(tp=2, ep=1, etp=1)]


def _grid_counts(rank, world):
    out = []
    for lay in LAYOUTS:
        topo = Topology(world, rank, **lay).create_groups()
        out.append([_rank_counts(_shape(**kw), topo, 1, 1, 0) for kw in VARIANTS[:2]])
    return out


def test_moe_params_match_the_model_on_the_expert_grid(distributed):
    """Two ranks: EP 2 (half the experts each), TP 2 with ETP 2 / 1, TP 2 x EP 2 with ETP 1."""
    got = distributed(_grid_counts, 2)
    want = [[(plan.stage_params(_shape(**kw), lay["tp"], 1, 0, ep=lay["ep"], etp=lay.get("etp")),
              plan.stage_param_split(_shape(**kw), lay["tp"], 1, 0, ep=lay["ep"], etp=lay.get("etp"))[1])
             for kw in VARIANTS[:2]] for lay in LAYOUTS]
    assert got[0] == got[1] == want


def _zero_states(rank, world):
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank, ep=2).create_groups()
    model = GPTModel(_shape(params_dtype=torch.bfloat16), topo)
    return [ZeroOptimizer([model], topo, stage=stage, params_dtype=torch.bfloat16, param_persistence_threshold=0,
                          expert_params=expert_parallel_params([model])).state_bytes()["total"]
            for stage in range(4)]


def test_moe_model_states_match_zero_optimizer(distributed):
    """DP 4 x EP 2, bf16: dense states over DP 4, expert states over EDP 2; the optimizer's
    buffers equal the planner's figure at every stage (within 2 %: shard padding)."""
    got = distributed(_zero_states, 4)[0]
    shape = _shape(params_dtype=torch.bfloat16)
    dense, expert = plan.stage_param_split(shape, 1, 1, 0, ep=2)
    for stage, total in enumerate(got):
        x = plan.estimate(shape, 1, 1, 4, stage, micro_batch_size=1, micro_batches=1, ep=2, grad_bytes=4)
        assert x.edp == 2 and x.expert_params == expert
        want = plan.model_state_bytes(dense, stage, 4, 2, 4) + plan.model_state_bytes(expert, stage, 2, 2, 4)
        assert x.model_state_bytes == pytest.approx(want)
        assert total == pytest.approx(want, rel=0.02), stage


def test_dispatcher_and_expert_gradient_volumes():
    """alltoall: 4 T k h A (EP-1)/EP per MoE layer and micro-batch (T = s b / TP); allgather:
    4 (G-1) T h A; expert gradients reduced over EDP like the dense ones over DP."""
    s, b, h, m, A = 8, 2, 32, 3, 4  # fp32: 4-byte activations
    kw = dict(micro_batch_size=b, micro_batches=m, param_bytes=4, grad_bytes=4)
    for dispatcher in ("alltoall", "allgather"):
        shape = _shape(moe_token_dispatcher_type=dispatcher)
        x = plan.estimate(shape, 2, 1, 4, 1, ep=4, etp=1, sequence_parallel=True, **kw)
        assert (x.ep, x.etp, x.edp) == (4, 1, 2)
        T = s * b / 2
        per_layer = 4 * T * 2 * h * A * 3 / 4 if dispatcher == "alltoall" else 4 * 3 * T * h * A
        assert x.comm_ep_bytes == pytest.approx(m * 3 * per_layer)  # 3 MoE layers of 4
        phi_e = x.expert_params
        assert x.comm_edp_bytes == pytest.approx(A * phi_e / 2 + A * phi_e / 2)  # ZeRO 1: RS(g) + AG(p), n = 2
    full = plan.estimate(_shape(), 1, 1, 4, 1, ep=4, recompute="full", **kw)
    assert full.comm_ep_bytes == pytest.approx(1.5 * plan.estimate(_shape(), 1, 1, 4, 1, ep=4, **kw).comm_ep_bytes)
    assert plan.estimate(_shape(), 1, 1, 4, 0, ep=1, **kw).comm_ep_bytes == 0  # every expert local
    dropped = _shape(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    assert plan.routed_rows(dropped, 16) == 4 * 4  # capacity ceil(16 2 / 4 0.5) = 4 rows per expert


def test_moe_activations_keep_routed_rows():
    """No recompute, PP 1: an MoE model keeps (number of MoE layers) x the MoE block's delta more than
    the dense model of the same shape; the delta counts T k rows of 2h + 2u + 2f + 2h (ETP 1)."""
    s, b, h, f = 8, 1, 32, 16
    shape = _shape()
    dense = GPTConfig.from_megatron({k: v for k, v in MOE.items() if not k.startswith(("moe_", "num_exp"))},
                                    vocab_size=50)
    delta = plan.moe_activation_delta(shape, s, b, 1, False, 1)
    assert delta == 3 * s * b * h + s * b * 2 * (2 * h + 2 * 2 * f + 2 * f + 2 * h) - 19 * s * b * h
    moe_x = plan.estimate(shape, 1, 1, 1, 0, micro_batch_size=b, micro_batches=1)
    dense_x = plan.estimate(dense, 1, 1, 1, 0, micro_batch_size=b, micro_batches=1)
    assert moe_x.activation_bytes - dense_x.activation_bytes == pytest.approx(3 * delta)


def test_layouts_range_over_the_expert_grid():
    shape = _shape()
    layouts = plan.plan(shape, 8, micro_batch_size=1, pp=1)
    assert {x.ep for x in layouts} == {1, 2, 4}  # EP divides the 4 experts
    for x in layouts:
        assert (x.tp * x.dp) % (x.etp * x.ep) == 0 and x.edp == x.tp * x.dp // (x.etp * x.ep) and x.etp == x.tp
    by = {(x.tp, x.zero, x.ep): x for x in layouts}
    # ZeRO 3 spreads the expert states over EP x EDP = TP DP / ETP ranks whatever EP is
    assert by[1, 3, 4].model_state_bytes == pytest.approx(by[1, 3, 1].model_state_bytes)
    assert by[1, 0, 4].model_state_bytes < by[1, 0, 2].model_state_bytes < by[1, 0, 1].model_state_bytes
    fixed = plan.plan(shape, 8, micro_batch_size=1, pp=1, tp=2, ep=2, etp=1)
    assert fixed and {(x.ep, x.etp, x.edp) for x in fixed} == {(2, 1, 4)}
    assert not plan.plan(shape, 8, micro_batch_size=1, ep=3)  # 3 does not divide 4 experts
    dense = plan.plan(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50), 4,
                      micro_batch_size=1)
    assert all((x.ep, x.etp, x.edp, x.expert_params, x.comm_ep_bytes) == (1, x.tp, x.dp, 0, 0) for x in dense)


def test_cli_reads_the_moe_flags(capsys):
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--vocab-size", "100", "--world-size", "8", "--swiglu",
            "--disable-bias-linear", "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
            "--moe-layer-freq", "([1]+[0])*2", "--moe-shared-expert-intermediate-size", "64", "--bf16"]
    assert planner_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("MoE: 8 experts (FFN 32), top-2, 2 of 4 layers, shared expert 64")
    h = next(i for i, line in enumerate(lines) if line.split()[:2] == ["TP", "PP"])
    assert lines[h].split()[:8] == ["TP", "PP", "VP", "DP", "ZeRO", "EP", "ETP", "EDP"]
    assert planner_main(argv + ["--json", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size",
                                "1", "--tensor-model-parallel-size", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all((r["ep"], r["etp"], r["tp"]) == (4, 1, 2) and r["edp"] == 2 * r["dp"] // 4 for r in rows)
    assert all(r["expert_params"] > 0 and r["comm_ep_bytes"] > 0 for r in rows)
