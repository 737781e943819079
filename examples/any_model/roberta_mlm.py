"""A Hugging Face RoBERTa masked-LM trained with ZeRO through ``megazero.initialize``: the
DeepSpeed way (engine(...), engine.backward(loss), engine.step()), on CPU or GPU.

    torchrun --nproc-per-node 2 examples/any_model/roberta_mlm.py            # CPU, gloo, < 1 minute
    python examples/any_model/roberta_mlm.py --steps 5                       # one process
    torchrun ... roberta_mlm.py --config my_ds_config.json --save /tmp/ckpt  # any DeepSpeed config

The model is a small random RobertaForMaskedLM; the data are tokens drawn from a Zipf law
(``P(k) ~ 1 / k``) of which 15% are masked, so the loss falls from ln(vocabulary) = 6.9 towards
the law's entropy (printed at the start), the best a model without context can do. A checkpoint saved with
``--save`` loads at any DP size (``--load``), and ``python -m megazero.checkpoint.zero_to_fp32 DIR OUT``
writes one fp32 state dict that ``RobertaForMaskedLM.load_state_dict`` takes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # this checkout's megazero, installed or not
import megazero  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description="RoBERTa MLM with megazero.initialize")
    p.add_argument("--config", default=os.path.join(HERE, "ds_config.json"))
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    a = p.parse_args()
    torch.manual_seed(0)  # the same initial model on every rank (initialize checks it)
    cfg = transformers.RobertaConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=512, max_position_embeddings=a.seq + 4, type_vocab_size=1)
    model = transformers.RobertaForMaskedLM(cfg)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    engine, optimizer, _, scheduler = megazero.initialize(
        model=model, config=a.config,
        model_parameters=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    if a.load:
        engine.load_checkpoint(a.load)
    rank = engine.global_rank
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    zipf = 1.0 / torch.arange(1, cfg.vocab_size - 4, dtype=torch.float64)
    zipf /= zipf.sum()
    if rank == 0:
        print(f"Zipf entropy {-(zipf * zipf.log()).sum().item():.3f} (ln V = {torch.tensor(cfg.vocab_size).log():.3f})")
    micro, start = engine.train_micro_batch_size_per_gpu(), time.time()
    engine.train()
    while engine.global_steps < a.steps:
        ids = 5 + torch.multinomial(zipf, micro * a.seq, replacement=True, generator=g).view(micro, a.seq)
        mask = torch.rand(ids.shape, generator=g) < 0.15
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        inputs = torch.where(mask, torch.full_like(ids, 4), ids)
        loss = engine(input_ids=inputs, labels=labels).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary and rank == 0 and engine.global_steps % 5 == 0:
            print(f"step {engine.global_steps:4d} | loss {loss.item():.4f} | lr {engine.get_lr()[0]:.3e} | "
                  f"grad norm {engine.get_global_grad_norm():.3f} | {time.time() - start:.1f} s", flush=True)
    if a.save:
        engine.save_checkpoint(a.save)
        if rank == 0:
            print(f"saved {a.save}", flush=True)


if __name__ == "__main__":
    main()
