"""A model that is not a GPT trains through the generic packages: residual MLP blocks with a tied
input/output matrix, split over PP 2 x VP 2 (interleaved 1F1B), ZeRO 3 over DP 2 (world 4), equals
one process with torch.optim.AdamW on the unsharded model (same batches) -- first driven through
PipelineRunner + ZeroOptimizer directly, then through the training loop (setup / Trainer.train).

The model: ``h_0 = E[tokens]``; block ``n``: ``h <- h + W2_n gelu(W1_n LN_n(h) + b1_n) + b2_n``;
logits ``= LN_f(h) E^T`` (the token embedding ``E`` is also the output projection); loss: mean
token cross-entropy over the unmasked tokens. With PP > 1 the first stage holds ``E`` and the
last stage a copy (``out``, drawn from the same seed), kept equal by summing their gradients over
``topo.embedding_group`` (``ModelStages.shared_params``). Every parameter is drawn from a
generator seeded by its global name, so every layout starts from the same model.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megazero.model.stages import ModelStages
from megazero.pipeline import chunk_layer_ranges, chunk_roles
from megazero.testing import run_distributed

V, H, L, S, MB, M, STEPS = 24, 16, 8, 6, 2, 4, 4
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
TOL = 1e-5  # max |a - b| / max |b| per tensor, as the ZeRO and pipeline equivalence tests


def _draw(shape, name, scale):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return nn.Parameter(torch.randn(shape, generator=g) * scale)


class Block(nn.Module):
    """``h + W2 gelu(W1 LN(h) + b1) + b2``."""

    def __init__(self, hidden: int, n: int):
        super().__init__()
        self.norm_weight = _draw((hidden,), f"layers.{n}.norm_weight", 0.1)
        self.norm_bias = _draw((hidden,), f"layers.{n}.norm_bias", 0.1)
        self.w1 = _draw((2 * hidden, hidden), f"layers.{n}.w1", hidden ** -0.5)
        self.b1 = _draw((2 * hidden,), f"layers.{n}.b1", 0.1)
        self.w2 = _draw((hidden, 2 * hidden), f"layers.{n}.w2", (2 * hidden) ** -0.5)
        self.b2 = _draw((hidden,), f"layers.{n}.b2", 0.1)

    def forward(self, h):
        x = F.layer_norm(h, h.shape[-1:], 1.0 + self.norm_weight, self.norm_bias)
        return h + F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class MLPChunk(nn.Module):
    """Global blocks ``layer_start..layer_end-1``; ``pre_process``: the embedding ``E``;
    ``post_process``: final norm, ``E^T`` (or its copy ``out``) and the per-token loss."""

    def __init__(self, vocab, hidden, layer_start, layer_end, pre_process, post_process):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embed = _draw((vocab, hidden), "embed", 1.0)
        self.layers = nn.ModuleDict({str(n): Block(hidden, n) for n in range(layer_start, layer_end)})
        if post_process:
            self.norm_weight = _draw((hidden,), "norm_weight", 0.1)
            self.norm_bias = _draw((hidden,), "norm_bias", 0.1)
            if not pre_process:
                self.out = _draw((vocab, hidden), "embed", 1.0)  # the tied copy, equal at start

    def tied_matrix(self):
        return self.embed if self.pre_process else self.out

    def forward(self, x, labels=None):
        h = self.embed[x] if self.pre_process else x  # [b, s, h]
        for block in self.layers.values():
            h = block(h)
        if not self.post_process:
            return h
        h = F.layer_norm(h, h.shape[-1:], 1.0 + self.norm_weight, self.norm_bias)
        logits = h @ self.tied_matrix().t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    def global_params(self) -> dict:
        """Global name -> parameter; the copy ``out`` is reported as ``embed``."""
        return {("embed" if name == "out" else name): p for name, p in self.named_parameters()}


def mlp_forward_step(chunk, micro_batch, input_tensor):
    """Hidden states, or on the last stage ``sum(loss * loss_mask) / sum(loss_mask)``."""
    x = micro_batch["tokens"] if input_tensor is None else input_tensor
    if not chunk.post_process:
        return chunk(x)
    losses = chunk(x, micro_batch["labels"])
    mask = micro_batch.get("loss_mask")
    return losses.mean() if mask is None else (losses * mask).sum() / mask.sum()


def mlp_stages(vocab, hidden, num_layers, seq_length, micro_batch_size, topo) -> ModelStages:
    """This model's provider: Megatron's interleaved layer assignment, activations ``[b, s, h]``,
    the tied matrix's two copies shared over the embedding group."""
    ranges = chunk_layer_ranges(num_layers, topo.pp, topo.vp, topo.pp_rank)
    roles = chunk_roles(topo.pp, topo.vp, topo.pp_rank)
    chunks = [MLPChunk(vocab, hidden, a, b, pre, post) for (a, b), (pre, post) in zip(ranges, roles)]
    shared = []
    if topo.pp > 1 and topo.is_first_stage:
        shared.append((chunks[0].embed, topo.embedding_group))
    if topo.pp > 1 and topo.is_last_stage:
        shared.append((chunks[-1].out, topo.embedding_group))
    return ModelStages(chunks=chunks, activation_shape=(micro_batch_size, seq_length, hidden),
                       activation_dtype=torch.float32, shared_params=shared, aliases={"out": "embed"})


def batches(steps, dp, m, seed=0):
    """``data[step][dp_rank][micro]``: token / label / mask dicts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(dp):
            mbs = []
            for _ in range(m):
                tokens = torch.randint(0, V, (MB, S + 1), generator=g)
                mask = (torch.rand(MB, S, generator=g) > 0.2).float()
                mask[:, 0] = 1.0
                mbs.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
            step.append(mbs)
        out.append(step)
    return out


def reference(data, lr=LR, wd=WD, betas=BETAS, eps=EPS, clip=0.0):
    """One process, the whole model, torch.optim.AdamW (decay on matrices only, as ZeroOptimizer):
    per step the per-micro-batch losses ``[dp][m]`` before the update, and the final weights."""
    model = MLPChunk(V, H, 0, L, True, True)
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps, foreach=True)
    losses = []
    for step in data:
        mbs = [mb for rank in step for mb in rank]
        step_losses = []
        for mb in mbs:
            loss = mlp_forward_step(model, mb, None)
            (loss / len(mbs)).backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses).view(len(step), -1))
        if clip:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.global_params().items()}


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---- 1. PipelineRunner + ZeroOptimizer directly --------------------------------------------------
def _direct(rank, world, data):
    from megazero.parallel.topology import Topology
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank, tp=1, pp=2, vp=2).create_groups()
    stages = mlp_stages(V, H, L, S, MB, topo)
    opt = ZeroOptimizer(stages.chunks, topo, stage=3, num_micro_batches=M, lr=LR, weight_decay=WD, betas=BETAS,
                        eps=EPS, reduce_bucket_size=500, param_persistence_threshold=0, max_reuse_distance=0,
                        prefetch_bucket_size=600, shared_params=stages.shared_params,
                        tp_duplicated_params=stages.tp_duplicated_params)
    runner = PipelineRunner(topo, M, stages.activation_shape, stages.activation_dtype)
    losses = []
    for step in data:
        out = runner.run(stages.chunks, step[topo.dp_rank], mlp_forward_step, grad_scale=opt.loss_scale)
        losses.append(torch.stack(out) if out else None)
        opt.finish_grad_sync()
        assert opt.step()[0]
    assert runner.schedule == "interleaved-1f1b" and opt.gatherer is not None
    with opt.gathered_params():
        params = {k: p.detach().clone() for c in stages.chunks for k, p in c.global_params().items()}
    return topo.dp_rank, topo.is_last_stage, losses, params


def test_residual_mlp_pp2_vp2_zero3_dp2_equals_one_process():
    data = batches(STEPS, 2, M)
    ref_losses, ref_params = reference(data)
    seen = set()
    for rank, (dp_rank, last, losses, params) in enumerate(run_distributed(_direct, 4, data, timeout_s=120,
                                                                             collective_timeout_s=30)):
        if last:
            for it, (got, want) in enumerate(zip(losses, ref_losses)):
                assert rel(got, want[dp_rank]) <= TOL, f"rank {rank} step {it} losses"
        for name, p in params.items():
            assert rel(p, ref_params[name]) <= TOL, f"rank {rank} {name}: {rel(p, ref_params[name]):.2e}"
            seen.add(name)
    assert seen == set(ref_params)  # every parameter, both copies of the tied matrix, checked


# ---- 2. the same model through the training loop (setup / Trainer.train) -------------------------
ARGV = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", str(S),
        "--micro-batch-size", str(MB), "--global-batch-size", str(MB * M * 2), "--train-iters", str(STEPS),
        "--mock-data", "--vocab-size", str(V), "--lr", str(LR), "--lr-decay-style", "constant",
        "--weight-decay", str(WD), "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
        "--adam-eps", str(EPS), "--clip-grad", "0.05", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", str(L // 4),
        "--zero-stage", "3", "--zero-param-persistence-threshold", "0", "--zero-max-reuse-distance", "0",
        "--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo", "--seed", "3"]


def _trainer(rank, world, argv):
    import signal

    from megazero.arguments import parse_args
    from megazero.training import setup
    from megazero.training.signals import ExitSignal

    def provider(model_config, topo, micro_batch_size):
        return mlp_stages(model_config.vocab_size, model_config.hidden_size, model_config.num_layers,
                          model_config.seq_length, micro_batch_size, topo)

    fed = []  # the micro-batches the first virtual stage consumed, in order

    def forward_step(chunk, micro_batch, input_tensor):
        if input_tensor is None:
            fed.append({k: micro_batch[k].detach().clone() for k in ("tokens", "labels", "loss_mask")})
        return mlp_forward_step(chunk, micro_batch, input_tensor)

    trainer = setup(parse_args(argv, world_size=world), model_provider=provider, forward_step_func=forward_step)
    trainer.train(ExitSignal.install((signal.SIGUSR1,)))
    trainer.tb.close()
    assert trainer.optimizer.stage == 3 and trainer.topo.vp == 2
    with trainer.optimizer.gathered_params():
        params = {k: p.detach().clone() for c in trainer.chunks for k, p in c.global_params().items()}
    return trainer.topo.dp_rank, trainer.topo.pp_rank, trainer.history, fed, params


def test_residual_mlp_through_the_trainer_equals_one_process():
    results = run_distributed(_trainer, 4, ARGV, timeout_s=120, collective_timeout_s=30)
    fed = {dp: f for dp, pp, _, f, _ in results if pp == 0}
    assert sorted(fed) == [0, 1] and all(len(f) == STEPS * M for f in fed.values())
    data = [[fed[dp][it * M:(it + 1) * M] for dp in (0, 1)] for it in range(STEPS)]
    ref_losses, ref_params = reference(data, clip=0.05)
    history = results[-1][2]  # the last rank logs the DP-mean loss of every step
    assert [i for i, _ in history] == list(range(1, STEPS + 1))
    for (_, got), want in zip(history, ref_losses):
        assert abs(got - want.mean().item()) <= TOL * abs(want.mean().item())
    for rank, (*_, params) in enumerate(results):
        for name, p in params.items():
            assert rel(p, ref_params[name]) <= TOL, f"rank {rank} {name}: {rel(p, ref_params[name]):.2e}"
