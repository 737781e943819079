"""Tiny random transformers models, batches and the one-process torch.optim.AdamW reference of the
engine tests (the same weights from the same seed in every process)."""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO = 64, 8, 2
LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 0.3


def build(kind: str):
    """``roberta`` (RobertaForMaskedLM) or ``gpt2`` (GPT2LMHeadModel, tied LM head), no dropout."""
    import transformers
    torch.manual_seed(1234)
    if kind == "roberta":
        cfg = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=SEQ + 4, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, pad_token_id=1, type_vocab_size=1)
        model = transformers.RobertaForMaskedLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    return model


def groups(model):
    """Hugging Face's usual split: no weight decay on biases and LayerNorm weights."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (rest if name.endswith("bias") or "LayerNorm" in name or ".ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]


def batches(kind: str, steps: int, dp: int, gas: int, seed: int = 0):
    """``data[step][dp_rank][micro]`` = (input_ids, labels): MLM labels (-100 where not masked)
    for roberta, the inputs themselves for gpt2 (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(dp):
            micro = []
            for _ in range(gas):
                ids = torch.randint(3, VOCAB, (MICRO, SEQ), generator=g)
                if kind == "roberta":
                    mask = torch.rand(MICRO, SEQ, generator=g) < 0.3
                    mask[:, 0] = True
                    labels = torch.where(mask, ids, torch.full_like(ids, -100))
                    ids = torch.where(mask, torch.full_like(ids, 2), ids)
                else:
                    labels = ids
                micro.append((ids, labels))
            step.append(micro)
        out.append(step)
    return out


def reference(kind: str, data, clip: float = CLIP):
    """One process, torch.optim.AdamW on the same groups: losses ``[step][dp][micro]`` and the
    final state dict."""
    model = build(kind)
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for step in data:
        n = sum(len(r) for r in step)
        per = []
        for rank in step:
            row = []
            for ids, labels in rank:
                loss = model(input_ids=ids, labels=labels).loss
                (loss / n).backward()
                row.append(loss.item())
            per.append(row)
        losses.append(per)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_losses(engine, data, rank: int) -> list[float]:
    """Train a DeepSpeed-style ``engine`` (megazero's or DeepSpeed's) on rank ``rank``'s
    micro-batches of every step of ``data`` (:func:`batches`); the per-micro-batch losses."""
    out = []
    for step in data:
        for ids, labels in step[rank]:
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
    return out
