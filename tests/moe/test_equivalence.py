"""Every expert-parallel layout trains the MoE GPT exactly as one process does.

Per-iteration losses (DP means) within 1e-5 of a single process running the same micro-batches
(the reference scales each micro-batch's LM and aux losses by 1 / their count, as the layouts do
by ``1 / M`` then the DP mean), and the final parameters within 1e-4 (AdamW's first steps divide
by ``sqrt(v)``, which magnifies fp32 rounding of the tiny router gradients). ZeRO 1 and 3 run in
one launch per layout. fp32, 3 steps, aux + z losses on, a dense layer among the MoE ones.
"""

from __future__ import annotations

import pytest
import torch

from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.moe.helpers import args_for, gpt_batches, reference, train

STEPS, M = 3, 2


def _layouts(rank, world, sizes, stages, data, overrides, opt):
    torch.set_num_threads(1)
    topo = Topology(world, rank, **sizes).create_groups()
    return [train(topo, data, args_for(stage, M, **opt), **overrides) for stage in stages]


def _check(world, sizes, stages=(1, 3), clip=0.0, loss_tol=1e-5, param_tol=1e-4, opt=None, **overrides):
    dp = world // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1))
    data = gpt_batches(STEPS, dp, M)
    ref_losses, ref_full = reference(data, clip=clip, **{k: v for k, v in overrides.items() if k != "params_dtype"})
    opt = dict(opt or {}, clip_grad=clip)
    results = run_distributed(_layouts, world, sizes, stages, data, overrides, opt, timeout_s=300)
    for s, stage in enumerate(stages):
        losses = next(r[s][0] for r in results if r[s][0] is not None)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < loss_tol, (stage, losses, ref_losses)
        if param_tol is None:
            continue
        for rank_result in results:
            for name, value in rank_result[s][1].items():
                want = ref_full.get(name, ref_full.get("embedding.word_embeddings.weight"))  # tied copy
                err = (value - want).abs().max().item()
                assert err < param_tol, (stage, name, err)


def test_ep2_dp4_zero1_and_zero3():
    """EP 2 carved out of DP 4: two expert-DP replicas of each expert half."""
    _check(4, dict(ep=2))


def test_tp2_sp_ep2_dp2():
    """TP 2 with sequence parallelism, EP 2 over DP 2, expert TP = TP (expert weights split)."""
    _check(4, dict(tp=2, ep=2), sequence_parallel=True)


def test_tp2_with_expert_tp1():
    """ETP 1 != TP 2: each TP rank's tokens go to whole experts on the EP peer (Megatron's
    recommended MoE layout); expert gradients reduced over the stage's ranks 2 apart."""
    _check(4, dict(tp=2, ep=2, etp=1), sequence_parallel=True)


def test_pp2_vp2_ep2_dp2():
    """Interleaved 1F1B (PP 2, VP 2: a layer per chunk, MoE and dense chunks) x EP 2 x DP 2."""
    _check(4, dict(pp=2, vp=2, ep=2))


@pytest.mark.parametrize("dispatcher", ["allgather"])
def test_allgather_dispatcher_tp2_ep2(dispatcher):
    _check(4, dict(tp=2, ep=2), stages=(1,), sequence_parallel=True, moe_token_dispatcher_type=dispatcher)


@pytest.mark.parametrize("policy,pad", [("probs", False), ("position", True)])
def test_token_dropping_equals_single_process_rule(policy, pad):
    """Capacity factor 0.5 drops a quarter of the pairs or more; each rank routes its own
    micro-batch, as the single process does, so the same tokens are dropped."""
    _check(4, dict(ep=2), stages=(1,), moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy,
           moe_pad_expert_input_to_capacity=pad)


def test_sigmoid_grouped_routing_with_expert_bias_and_seq_aux_loss():
    """DeepSeek-V3's router: sigmoid scores, group-limited top-k, aux-loss-free expert bias
    (updated from the counts summed over every rank), a sequence-level aux loss."""
    _check(4, dict(ep=2), stages=(3,), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=0.01, moe_router_num_groups=2, moe_router_group_topk=1,
           moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01, moe_router_topk_scaling_factor=2.5,
           moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)


def test_clipping_counts_every_parameter_once():
    """A clip that engages every step: the global norm adds each expert (held by one EP rank,
    replicated over its expert-DP ranks at ZeRO 0, sharded at 2) and each dense parameter once."""
    _check(4, dict(tp=2, ep=2, etp=1), stages=(0, 2), clip=0.05, sequence_parallel=True)


def test_bf16_params_with_fp32_masters():
    """bf16 weights (fp32 masters and gradient accumulation) track the fp32 single process to
    bf16 rounding."""
    _check(4, dict(ep=2), stages=(1, 3), loss_tol=3e-2, param_tol=None, params_dtype=torch.bfloat16,
           opt=dict(params_dtype=torch.bfloat16, bf16=True))


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_context_parallel_cp2_ep2(comm):
    """5D's new pair: CP 2 x EP 2 (experts carved out of DP x CP), the router's statistics summed
    over the ranks holding one sequence, the aux losses weighted as one process's."""
    _check(4, dict(cp=2, ep=2), stages=(1,), cp_comm_type=comm, moe_router_load_balancing_type="seq_aux_loss")


def test_five_d_tp2_cp2_ep2_pp2():
    """TP 2 (SP) x CP 2 x EP 2 x PP 2 on 8 ranks (EP from the DP x CP ranks), ZeRO 3."""
    _check(8, dict(tp=2, cp=2, ep=2, pp=2), stages=(3,), sequence_parallel=True)


def test_fp16_params_with_loss_scaling():
    """fp16 weights, a static loss scale of 128 (the aux losses' gradient scaled alike), fp32
    masters: within fp16 rounding of the fp32 single process."""
    _check(4, dict(ep=2), stages=(1,), loss_tol=3e-2, param_tol=None, params_dtype=torch.float16,
           opt=dict(params_dtype=torch.float16, fp16=True, loss_scale=128.0))


# DeepSeek-V3's MoE shrunk: 8 experts in 4 groups, 2 groups kept per token, top-4 (so each group
# is scored by its top-2 biased sigmoids, as both Megatron's group_limited_topk and transformers'
# DeepseekV3TopkRouter do when topk / group_topk = 2), the sigmoid weights normalized over the
# top-k and scaled by 2.5, aux-loss-free expert bias, a shared expert without gate, the first
# layer dense (first_k_dense_replace = 1) and a small sequence-level aux loss.
DSV3 = dict(num_experts=8, moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
            moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.01, moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=0.001, moe_z_loss_coeff=None, moe_shared_expert_intermediate_size=8,
            moe_layer_freq="[0,1,1,1]")


@pytest.mark.parametrize("sizes,sp", [(dict(tp=2, ep=2), True), (dict(ep=4), False)], ids=["ep2xtp2", "ep4"])
def test_deepseek_v3_routing_zero_1_2_3(sizes, sp):
    """The DeepSeek-V3 router (``DSV3``) at EP 2 x TP 2 (SP) and at EP 4, ZeRO 1, 2 and 3 in one launch."""
    _check(4, sizes, stages=(1, 2, 3), sequence_parallel=sp, **DSV3)
