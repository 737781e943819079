"""Zero-bubble schedules (split backward: B = input gradients, W = weight gradients) train the GPT
exactly as one process does: per-iteration losses and gradient norms within 1e-5 (fp32) and the
final weights within 1e-4, through ModelStages, PipelineRunner and ZeroOptimizer as training
builds them, at PP 2 and 4, with TP 2 (+SP), ZeRO 1, 2 and 3 (W on released units), MoE at EP 2,
CP 2 and recompute; bf16 within the bf16 tolerance. ZeRO's gradient hooks fire for a deferred
weight at its W only."""

from __future__ import annotations

import pytest
import torch

from megazero.parallel.topology import Topology

from .toy import launch

SEQ, MB, STEPS, VOCAB = 8, 2, 2, 40
VP = {"zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}  # chunks per rank
DENSE = dict(num_layers=8, hidden_size=16, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
             max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4,
             position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False)
MOE = dict(num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2, moe_aux_loss_coeff=0.01,
           moe_layer_freq="[1,0,1,0,1,1,0,1]", ffn_hidden_size=24)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
GPT2 = dict(position_embedding_type="learned_absolute", swiglu=False, normalization="LayerNorm",
            add_bias_linear=True, num_query_groups=4)
BF16 = dict(params_dtype=torch.bfloat16)
TIED = dict(untie_embeddings_and_output_weights=False)  # Megatron's default GPT


def _config(overrides):
    from megazero.model.config import GPTConfig
    values = dict(DENSE, params_dtype=torch.float32, untie_embeddings_and_output_weights=True)
    values.update(overrides)
    return GPTConfig.from_megatron(values, vocab_size=VOCAB)


def _lr(overrides):
    """bf16 and fp16 runs step at 1e-3, as tests/zero/test_wgrad_fusion.py (Adam's sign-like
    first steps would turn bf16 rounding of tiny gradients into lr-sized weight differences)."""
    return 1e-3 if overrides.get("params_dtype") in (torch.bfloat16, torch.float16) else 1e-2


def _batches(dp, m):
    g = torch.Generator().manual_seed(7)
    rand = lambda: torch.randint(0, VOCAB, (MB, SEQ), generator=g)  # noqa: E731
    return [[[{"tokens": rand(), "labels": rand(), "loss_mask": (torch.rand(MB, SEQ, generator=g) > 0.3).float()}
              for _ in range(m)] for _ in range(dp)] for _ in range(STEPS)]


def _reference(data, overrides):
    """One process: per-iteration mean loss and gradient norm, final weights (AdamW, clip 1)."""
    from megazero.model import GPTModel
    from megazero.model.stages import gpt_forward_step
    model = GPTModel(_config({k: v for k, v in overrides.items() if k != "params_dtype"}))
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=_lr(overrides), betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        if model.moe_state is not None:
            model.moe_state.set_aux_scale(1.0 / len(mbs))
        total = 0.0
        for mb in mbs:
            loss = gpt_forward_step(model, mb, None)
            (loss / len(mbs)).backward()
            total += loss.item() / len(mbs)
        norms.append(torch.nn.utils.clip_grad_norm_(ps, 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, model.full_state_dict()


def _runner(topo, stages, m):
    from megazero.pipeline import PipelineRunner
    return PipelineRunner(topo, m, stages.activation_shape, stages.activation_dtype)


def _hook_phases(stages):
    """Count, per deferring weight, the post-accumulate-grad hook calls (ZeRO's hook point) made
    while any chunk's store defers (in a B: must be none; the V's tied weight is used by both
    chunks) and in total."""
    fires = {"in_b": 0, "total": 0}
    for chunk in stages.chunks:
        for module in chunk.modules():
            if hasattr(module, "weight_grad_store") and getattr(module, "weight", None) is not None:
                def hook(p):
                    fires["in_b"] += any(s.defer for s in stages.weight_grad_stores)
                    fires["total"] += 1
                module.weight.register_post_accumulate_grad_hook(hook)
    return fires


def _train(rank, world, cases):
    import torch.distributed as dist

    from megazero.config.optimizer import OptimizerConfig
    from megazero.model.stages import gpt_stages
    from megazero.zero import ZeroOptimizer
    from tests.zero.gpt_helpers import args_for
    out = []
    for sizes, schedule, zero, overrides in cases:
        m = 2 * sizes["pp"]  # DualPipeV's least
        topo = Topology(world, rank, vp=VP[schedule], pipeline_schedule=schedule, **sizes).create_groups()
        stages = gpt_stages(_config(overrides), topo, MB)
        if topo.pp_rank == 0 and VP[schedule] == 2 and schedule != "interleaved-zb" and stages.shared_params:
            weight = stages.chunks[0].embedding.word_embeddings.weight  # the V, tied: one parameter
            assert [p for p, _ in stages.shared_params] == [weight] and stages.chunks[1].tied_output_weight() is weight
        bf16, fp16 = (overrides.get("params_dtype") == t for t in (torch.bfloat16, torch.float16))
        args = args_for(zero, m, clip_grad=1.0, lr=_lr(overrides), zero_reduce_bucket_size=500, params_dtype=stages.activation_dtype,
                        bf16=bf16, fp16=fp16, loss_scale=1024.0 if fp16 else None,
                        accumulate_allreduce_grads_in_fp32=bf16 or fp16)
        opt = ZeroOptimizer(stages.chunks, topo, **OptimizerConfig.from_args(args).kwargs(),
                            shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params,
                            expert_params=stages.expert_params)
        if opt.fuses_weight_grads:
            stages.fuse_vocab_grads(opt.add_weight_grad, opt.add_embedding_grad)
        fires = _hook_phases(stages)
        runner, losses, norms, stats = _runner(topo, stages, m), [], [], {}
        for step in _batches(topo.dp, m):
            if stages.moe is not None:
                stages.moe.set_aux_scale(opt.loss_scale / m)
            got = runner.run(stages.chunks, step[topo.dp_rank], stages.forward_step, grad_scale=opt.loss_scale,
                             stats=stats, weight_grad_stores=stages.weight_grad_stores)
            ok, norm = opt.step()
            assert ok
            norms.append(float(norm))
            if topo.is_last_stage:
                mean = torch.stack(got).mean().reshape(1)
                dist.all_reduce(mean, group=topo.dp_cp_group)
                losses.append(mean.item() / topo.dp_cp)
        with opt.gathered_params():
            full = {k: v.float().clone() for c in stages.chunks for k, v in c.full_state_dict().items()}
        assert fires["in_b"] == 0 and fires["total"] >= stats["deferred_weight_grads"] > 0, fires
        out.append((losses if topo.is_last_stage else None, norms, full, stats["deferred_weight_grads"]))
    return out


def _check(world, cases, loss_tol=1e-5, weight_tol=1e-4):
    results = launch(_train, world, cases, timeout_s=240)
    for i, (sizes, schedule, zero, overrides) in enumerate(cases):
        dp = world // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1))
        ref_losses, ref_norms, ref_full = _reference(_batches(dp, 2 * sizes["pp"]), overrides)
        what = f"{sizes} {schedule} ZeRO {zero} {sorted(overrides)}"
        losses = next(r[i][0] for r in results if r[i][0] is not None)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < loss_tol, (what, losses, ref_losses)
        for r in results:
            assert max(abs(a - b) / b for a, b in zip(r[i][1], ref_norms)) < loss_tol, (what, r[i][1], ref_norms)
            for name, value in r[i][2].items():
                want = ref_full.get(name, ref_full.get("embedding.word_embeddings.weight"))
                assert (value - want).abs().max().item() < weight_tol, (what, name)


@pytest.mark.parametrize("schedule", list(VP))
def test_pp2_pp4_tp2_zero123_recompute(schedule):
    """PP 2 x DP 2 (ZeRO 1, GPT-2), PP 2 x TP 2 + SP (ZeRO 2, recompute), PP 4 (ZeRO 2),
    PP 2 x DP 2 at ZeRO 3 (a unit is released at the end of its B; W runs on the shards)."""
    _check(4, [(dict(pp=2), schedule, 1, GPT2),
               (dict(pp=2, tp=2), schedule, 2, dict(sequence_parallel=True, **RECOMPUTE)),
               (dict(pp=4), schedule, 2, {}), (dict(pp=2), schedule, 3, {})])


def test_zero3_zbv_tp2_sp_recompute_and_moe():
    """ZeRO 3, where W runs on released parameters: zbv with TP 2 + SP and recompute over DP 2
    (8 ranks), zb-h1 with MoE (4 experts, EP 2: expert units inside layer units)."""
    _check(8, [(dict(pp=2, tp=2), "zbv", 3, dict(sequence_parallel=True, **RECOMPUTE)),
               (dict(pp=2, ep=2), "zb-h1", 3, MOE)])


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_moe_ep2_and_cp2(schedule):
    """MoE (4 experts, EP 2 over the DP ranks) and context parallelism (CP 2), at PP 2, ZeRO 1."""
    _check(4, [(dict(pp=2, ep=2), schedule, 1, MOE), (dict(pp=2, cp=2), schedule, 1, {})])


def test_bf16_with_gradient_accumulation_fusion_tracks_fp32():
    """Untied and tied (both vocabulary uses fused into the one weight's fp32 gradient) zbv at
    ZeRO 2; zb-h1 at ZeRO 3, where W's fused ``main_grad += G^T X`` meets released units; tied
    dualpipev in fp16 (constant loss scale 1024) with the fp32 masters."""
    _check(4, [(dict(pp=2), "zbv", 2, dict(GPT2, **BF16)), (dict(pp=2), "zbv", 2, dict(GPT2, **BF16, **TIED)),
               (dict(pp=2), "zb-h1", 3, dict(GPT2, **BF16))], loss_tol=3e-2, weight_tol=3e-2)
    _check(4, [(dict(pp=2), "dualpipev", 1, dict(GPT2, params_dtype=torch.float16, **TIED))], loss_tol=1e-3,
           weight_tol=5e-3)  # fp16 weights: one ulp of a norm weight near 1 is 1e-3


def _toy_without_stores(rank, world):
    """A model of plain parameters (no deferring layer, no stores): under every zero-bubble plan
    each B computes all gradients and W is nothing; per-micro-batch losses and gradients equal
    one process's."""
    from megazero.parallel.layout import chunk_placement
    from megazero.pipeline import forward_backward

    from .toy import reference, rel_err, toy_batches, toy_chunks, toy_step
    out = {}
    for schedule, vp in VP.items():
        topo = Topology(world, rank, pp=4, vp=vp, pipeline_schedule=schedule).create_groups()
        batches = toy_batches(8, 2, 4, 16, seed=3)
        ref_losses, ref_grads = reference(16, 8, 8, False, batches)
        chunks = toy_chunks(16, 8, 8, 4, vp, topo.pp_rank, False, placement=chunk_placement(schedule))
        stats = {}
        losses = forward_backward(chunks, batches, topo, toy_step, (4, 2, 8), torch.float32, stats=stats)
        errs = {"loss": rel_err(torch.stack(losses), ref_losses)} if topo.is_last_stage else {}
        errs.update({k: rel_err(g, ref_grads[k]) for c in chunks for k, g in c.named_grads().items()})
        out[schedule] = (errs, stats["deferred_weight_grads"], stats["schedule"])
    return out


def test_zero_bubble_plans_without_stores_compute_whole_backwards():
    results = launch(_toy_without_stores, 4, timeout_s=60)
    for schedule in VP:
        assert sum("loss" in r[schedule][0] for r in results) == 1  # the last stage's rank: 3, or 0 in the V
        for rank, r in enumerate(results):
            errs, deferred, name = r[schedule]
            assert name == schedule and deferred == 0
            assert all(v <= 1e-5 for v in errs.values()), (rank, schedule, errs)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_tied_embeddings_with_the_v(schedule):
    """Tied word embeddings with the V (embedding and output layer: chunks 0 and 1 of pipeline
    rank 0, one parameter): PP 2 x DP 2 at ZeRO 0 (GPT-2: learned positions) and ZeRO 3, PP 2 x
    TP 2 + SP (vocab-parallel) at ZeRO 1, PP 4 at ZeRO 2 -- the one-process tied model's losses
    and norms within 1e-5."""
    _check(4, [(dict(pp=2), schedule, 0, dict(GPT2, **TIED)), (dict(pp=2), schedule, 3, TIED),
               (dict(pp=2, tp=2), schedule, 1, dict(TIED, sequence_parallel=True)), (dict(pp=4), schedule, 2, TIED)])
