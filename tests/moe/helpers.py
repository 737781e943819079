"""MoE GPTs trained by a single process and by expert-parallel layouts (helpers for tests)."""

from __future__ import annotations

import torch

from tests.zero.gpt_helpers import MB, args_for, gpt_batches

MOE = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
           attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4, add_bias_linear=False,
           swiglu=True, ffn_hidden_size=24, num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_layer_freq="[1,0,1,1]")
VOCAB = 40

__all__ = ["MOE", "VOCAB", "MB", "args_for", "gpt_batches", "moe_config", "reference", "train"]


def moe_config(**overrides):
    from megazero.model.config import GPTConfig
    values = dict(MOE, **overrides)
    values["params_dtype"] = values.get("params_dtype", torch.float32)
    return GPTConfig.from_megatron(values, vocab_size=VOCAB)


def _adamw(params, lr=1e-2, wd=0.1):
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def reference(data, clip=0.0, mtp_log=None, **overrides):
    """Single process: every step's micro-batches in one loop, the aux losses scaled by 1 / their
    count like the mean LM loss; returns (per-step mean losses, final full state). ``mtp_log``: a
    list that gets each step's mean multi-token-prediction losses (one per depth)."""
    from megazero.model import GPTModel
    model = GPTModel(moe_config(**overrides))
    ps = [p for p in model.parameters()]
    opt, losses = _adamw(ps), []
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        model.moe_state.set_aux_scale(1.0 / len(mbs))
        total = 0.0
        for mb in mbs:
            loss = model(mb["tokens"], labels=mb["labels"]).mean()
            (loss / len(mbs)).backward()
            total += loss.item() / len(mbs)
        if clip:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        opt.zero_grad()
        if model.config.moe is not None:
            model.moe_state.update_expert_bias(model.config.moe.bias_update_rate)
        if mtp_log is not None:
            mtp_log.append((model.moe_state.take()["mtp_loss"][:model.config.mtp_num_layers] / len(mbs)).tolist())
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}


def train(topo, data, args, mtp_log=None, **overrides):
    """This rank's MoE GPT stages trained like ``pretrain_gpt`` does (ModelStages, PipelineRunner,
    ZeroOptimizer with the expert parameters on the expert-DP group); returns (per-step DP-mean
    losses on the last stage, else None; the full state of this rank's chunks)."""
    import torch.distributed as dist

    from megazero.config.optimizer import OptimizerConfig
    from megazero.model.stages import gpt_stages
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    stages = gpt_stages(moe_config(**overrides), topo, MB)
    opt = ZeroOptimizer(stages.chunks, topo, **OptimizerConfig.from_args(args).kwargs(),
                        shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params,
                        expert_params=stages.expert_params)
    runner = PipelineRunner(topo, args.num_micro_batches, stages.activation_shape, stages.activation_dtype)
    losses = []
    for step in data:
        stages.moe.set_aux_scale(opt.loss_scale / args.num_micro_batches)
        out = runner.run(stages.chunks, step[topo.dp_rank], stages.forward_step, grad_scale=opt.loss_scale,
                         weight_grad_stores=stages.weight_grad_stores)  # used by zero-bubble plans only
        config = stages.chunks[0].config
        if config.moe is not None:
            stages.moe.update_expert_bias(config.moe.bias_update_rate)
        ok, _ = opt.step()
        assert ok
        if mtp_log is not None:  # the logged value: recorded / TP per rank, summed over the world / (M DP)
            sums = stages.moe.take()
            mtp = sums.get("mtp_loss", torch.zeros(stages.moe.num_layers))[:config.mtp_num_layers] / args.num_micro_batches
            dist.all_reduce(mtp)
            mtp_log.append((mtp / topo.dp).tolist())
        if topo.is_last_stage:
            mean = torch.stack(out).mean().reshape(1)
            dist.all_reduce(mean, group=topo.dp_cp_group)
            losses.append(mean.item() / topo.dp_cp)
    with opt.gathered_params():
        full = {}
        for c in stages.chunks:
            full.update({k: v.float().clone() for k, v in c.full_state_dict().items()})
    return (losses if topo.is_last_stage else None), full
