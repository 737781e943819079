"""ZeRO composed with the real GPTModel, tensor and pipeline parallelism (helpers for tests)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

CFG = dict(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=40, seq_length=8,
           max_position_embeddings=8, attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4)
MB = 2


def gpt_batches(steps, dp, M, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append([[{"tokens": torch.randint(0, CFG["vocab_size"], (MB, CFG["seq_length"]), generator=g),
                      "labels": torch.randint(0, CFG["vocab_size"], (MB, CFG["seq_length"]), generator=g)}
                     for _ in range(M)] for _ in range(dp)])
    return out


def args_for(stage, M, **kw):
    a = dict(zero_stage=stage, num_micro_batches=M, lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
             adam_eps=1e-8, clip_grad=0.0, params_dtype=torch.float32, accumulate_allreduce_grads_in_fp32=False,
             fp16=False, bf16=False, loss_scale=None, initial_loss_scale=2.0 ** 32, min_loss_scale=1.0,
             loss_scale_window=1000, hysteresis=2, zero_reduce_bucket_size=2000,
             zero_overlap_comm=True, zero_prefetch_bucket_size=5000,
             zero_param_persistence_threshold=0, zero_max_live_parameters=10 ** 9, zero_max_reuse_distance=0,
             adam_w_mode=True)
    a.update(kw)
    return SimpleNamespace(**a)


def gpt_reference(data, *, tied=True, clip=0.0, lr=1e-2, wd=0.1, betas=(0.9, 0.95), eps=1e-8):
    from megazero.model import GPTConfig, GPTModel
    model = GPTModel(GPTConfig(**CFG, untie_embeddings_and_output_weights=not tied))
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps, foreach=True)
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        for mb in mbs:
            (model(mb["tokens"], labels=mb["labels"]).mean() / len(mbs)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.full_state_dict().items()}


def gpt_train(topo, data, args, tied=True, inspect=None):
    """Train this rank's GPT stages with a PipelineRunner and ZeroOptimizer, built from the flags
    exactly as training does (OptimizerConfig.from_args, the stages' shared/TP-duplicated lists);
    ``inspect(chunks, optimizer)`` runs before the first step (a test's hooks)."""
    from megazero.config.optimizer import OptimizerConfig
    from megazero.model import GPTConfig
    from megazero.model.stages import gpt_forward_step, gpt_stages
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    config = GPTConfig(**CFG, untie_embeddings_and_output_weights=not tied)
    stages = gpt_stages(config, topo, MB)
    chunks = stages.chunks
    opt = ZeroOptimizer(chunks, topo, **OptimizerConfig.from_args(args).kwargs(), shared_params=stages.shared_params,
                        tp_duplicated_params=stages.tp_duplicated_params)
    runner = PipelineRunner(topo, args.num_micro_batches, stages.activation_shape, stages.activation_dtype)
    if inspect is not None:
        inspect(chunks, opt)
    for step in data:
        runner.run(chunks, step[topo.dp_rank], gpt_forward_step, grad_scale=opt.loss_scale)
        opt.finish_grad_sync()
        ok, _ = opt.step()
        assert ok
    with opt.gathered_params():
        full = {}
        for c in chunks:
            full.update({k: v.float().clone() for k, v in c.full_state_dict().items()})
    return full, opt.last_comm["dp_logical_multiple"]


def compare(full, ref):
    worst = 0.0
    for k, v in full.items():
        r = ref.get(k, ref.get("embedding.word_embeddings.weight") if k == "output_layer.weight" else None)
        worst = max(worst, ((v - r).abs().max() / r.abs().max()).item())
    return worst
