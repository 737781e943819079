"""GPTModel chunks through the pipeline schedules equal the single-process GPT (fp32)."""

import torch

from megazero.model import GPTConfig, GPTModel
from megazero.model.stages import gpt_forward_step, gpt_stages
from megazero.pipeline import PipelineRunner, allreduce_shared_grads
from megazero.parallel.topology import Topology

from .toy import launch, rel_err

B, S, V = 2, 8, 50
WORD = "embedding.word_embeddings.weight"


def config(arch, tied, sp=False):
    common = dict(num_layers=8, hidden_size=16, num_attention_heads=4, vocab_size=V, seq_length=S,
                  attention_dropout=0.0, hidden_dropout=0.0, untie_embeddings_and_output_weights=not tied,
                  sequence_parallel=sp, init_method_std=0.2)
    if arch == "llama":
        return GPTConfig(**common, normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                         add_bias_linear=False, num_query_groups=2, ffn_hidden_size=32)
    return GPTConfig(**common, activation="gelu_tanh")


def batches(m, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, V, (B, S + 1), generator=g)
        mask = (torch.rand(B, S, generator=g) > 0.25).float()
        mask[:, 0] = 1.0
        pos = torch.arange(S).unsqueeze(0).expand(B, S)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask, "position_ids": pos})
    return out


def reference(cfg, mbs):
    model = GPTModel(cfg, None)
    losses = []
    for mb in mbs:
        loss = gpt_forward_step(model, mb, None)
        (loss / len(mbs)).backward()
        losses.append(loss.detach())
    return torch.stack(losses), model.full_state_dict(grads=True)


# (tp, pp, vp, m, sequence_parallel) x (arch, tied), on 8 ranks (the rest are DP replicas).
LAYOUTS = [(1, 2, 1, 4, False), (1, 2, 2, 4, False), (2, 2, 1, 2, True), (2, 2, 2, 4, False),
           (1, 4, 1, 4, False), (1, 4, 2, 4, False), (2, 4, 1, 8, False), (2, 4, 2, 4, True)]
MODELS = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)]


def _equivalence(rank, world):
    out = []
    for i, (tp, pp, vp, m, sp) in enumerate(LAYOUTS):
        topo = Topology(world, rank, tp=tp, pp=pp, vp=vp).create_groups()
        for arch, tied in (MODELS if i % 3 == 0 else MODELS[i % 2::2]):
            cfg = config(arch, tied, sp)
            mbs = batches(m, seed=i)
            ref_losses, ref_grads = reference(cfg, mbs)
            stages = gpt_stages(cfg, topo, B)
            chunks = stages.chunks
            runner = PipelineRunner(topo, m, stages.activation_shape, stages.activation_dtype)
            losses = runner.run(chunks, mbs, gpt_forward_step)
            allreduce_shared_grads(stages.shared_params)
            errs = {"loss": rel_err(torch.stack(losses), ref_losses)} if topo.is_last_stage else {}
            for chunk in chunks:
                for name, g in chunk.full_state_dict(grads=True).items():
                    key = WORD if (name == "output_layer.weight" and tied) else name
                    errs[name] = rel_err(g, ref_grads[key])
            out.append(((tp, pp, vp, m, sp, arch, tied), errs))
    return out


def test_gpt_pipeline_equals_single_process():
    seen = set()
    for rank, out in enumerate(launch(_equivalence, 8, timeout_s=120)):
        for case, errs in out:
            seen.add(case)
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad, f"rank {rank} (tp, pp, vp, m, sp, arch, tied)={case}: {bad}"
    assert {(c[1], c[2], c[0]) for c in seen} == {(pp, vp, tp) for pp in (2, 4) for vp in (1, 2) for tp in (1, 2)}
    assert {c[5:] for c in seen} == set(MODELS)


def _tied_adamw(rank, world):
    topo = Topology(world, rank, tp=2, pp=2, vp=2).create_groups()
    cfg = config("gpt2", True)
    stages = gpt_stages(cfg, topo, B)
    chunks, shared = stages.chunks, stages.shared_params
    assert stages.activation_shape == (S, B, 16) and stages.activation_dtype == torch.float32
    assert stages.aliases == {"output_layer.weight": WORD}
    runner = PipelineRunner(topo, 2, stages.activation_shape, stages.activation_dtype)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2)
    for it in range(20):
        opt.zero_grad(set_to_none=True)
        runner.run(chunks, batches(2, seed=100 + it), gpt_forward_step)
        allreduce_shared_grads(shared)
        opt.step()
    return shared[0][0].detach().clone() if shared else None


def test_gpt_tied_embedding_copies_bit_equal_after_20_adamw_steps():
    res = launch(_tied_adamw, 4, timeout_s=90)
    # ranks 0, 1: pipeline rank 0 (tp 0, 1) hold the embedding; ranks 2, 3: the last stage's copies
    assert res[0] is not None and res[2] is not None
    assert torch.equal(res[0], res[2]) and torch.equal(res[1], res[3])
    assert not torch.equal(res[0], res[1])  # different vocab shards
