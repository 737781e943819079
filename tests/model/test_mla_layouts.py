"""A multi-latent-attention GPT trains exactly as one process in every layout (fp32, per-iteration
losses within 1e-5, final weights within 1e-4 against ``torch.optim.AdamW`` on the whole model):
TP 2 with SP under ZeRO 1 and 2, PP 2 x VP 2 at ZeRO 3, CP 2 (ring and all-to-all), CP 2 x TP 2
with SP at ZeRO 3; bf16 at TP 2 + SP tracks fp32. The harness is
tests/context_parallel/test_equivalence.py's (its config with MLA's fields; ``num_query_groups=None``:
MLA has no GQA)."""

from __future__ import annotations

import pytest

from tests.context_parallel.test_equivalence import _check as check_layout

MLA = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=0.9,
           original_max_position_embeddings=8)


def test_mla_tp2_sp_zero1_and_zero2():
    check_layout(4, dict(tp=2), stages=(1, 2), sequence_parallel=True, **MLA)


def test_mla_pp2_vp2_zero3_selective_recompute_without_query_latent():
    check_layout(4, dict(pp=2, vp=2), stages=(3,), recompute_granularity="selective", **{**MLA, "q_lora_rank": None})


@pytest.mark.parametrize("comm, v_head_dim", [("p2p", 6), ("a2a", 6), ("p2p", 16)])
def test_mla_cp2(comm, v_head_dim):
    """The ring pads v (d_v 6 < d_q 12) or q, k (d_v 16) to one head size; the all-to-all needs none."""
    check_layout(2, dict(cp=2), stages=(0,), cp_comm_type=comm, **{**MLA, "v_head_dim": v_head_dim})


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_mla_zero_bubble_pp2(schedule):
    """Split backward (MLA's up and dense projections deferred to W) under zero-bubble plans."""
    check_layout(4, dict(pp=2, vp=1 if schedule == "zb-h1" else 2, pipeline_schedule=schedule), stages=(1, 3),
                 untie_embeddings_and_output_weights=True, **MLA)


def test_mla_cp2_tp2_sp_zero3():
    check_layout(4, dict(cp=2, tp=2), stages=(3,), sequence_parallel=True, **MLA)


def test_mla_bf16_tp2_sp_tracks_fp32():
    """bf16 weights and activations, fp32 masters: the one-process fp32 losses within bf16 rounding."""
    import torch
    check_layout(2, dict(tp=2), stages=(1,), loss_tol=3e-2, params_dtype=torch.bfloat16,
                 opt_kw=dict(params_dtype=torch.bfloat16, bf16=True), sequence_parallel=True, **MLA)
