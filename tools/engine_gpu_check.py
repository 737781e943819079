"""megazero.initialize on one device: GPT2LMHeadModel and RobertaForMaskedLM (tiny, random) at
ZeRO 0-3 in fp32 against torch.optim.AdamW on the same device (max relative loss difference over
4 steps with GAS 2 and clipping), then a bf16 ZeRO-3 run whose losses must stay within 5e-2
(relative) of the fp32 run's, with the peak device memory of each run.

    python tools/engine_gpu_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from tests.engine.hf_tiny import BETAS, CLIP, EPS, LR, batches, build, groups  # noqa: E402


def _peak(dev):
    return torch.cuda.max_memory_allocated() / 2 ** 20 if dev.type == "cuda" else float("nan")


def run(kind, zero, dev, dtype=None, steps=4, gas=2):
    import megazero
    data = batches(kind, steps, 1, gas)
    ref = build(kind).to(dev)
    opt = torch.optim.AdamW(groups(ref), lr=LR, betas=BETAS, eps=EPS)
    model = build(kind).to(dev)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS}},
           "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine, *_ = megazero.initialize(model=model, model_parameters=groups(model), config=cfg)
    worst, losses = 0.0, []
    for step in data:
        for ids, labels in step[0]:
            ids, labels = ids.to(dev), labels.to(dev)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if dtype is None:
                want = ref(input_ids=ids, labels=labels).loss
                (want / gas).backward()
                worst = max(worst, abs(loss.item() - want.item()) / abs(want.item()))
        if dtype is None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    engine.destroy()
    return worst, losses, _peak(dev)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(p.parse_args().device)
    ok = True
    for kind in ("gpt2", "roberta"):
        for zero in ({"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3, "stage3_param_persistence_threshold": 0}):
            worst, fp32, peak = run(kind, zero, dev)
            ok &= worst <= 1e-5
            print(f"{kind:8} fp32 ZeRO-{zero['stage']} on {dev}: max rel loss diff {worst:.2e}, peak {peak:.1f} MiB",
                  flush=True)
        _, losses, peak = run(kind, {"stage": 3, "stage3_param_persistence_threshold": 0}, dev, "bf16")
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, fp32))
        ok &= diff <= 5e-2
        print(f"{kind:8} bf16 ZeRO-3 on {dev}: max rel loss diff to fp32 {diff:.2e}, peak {peak:.1f} MiB", flush=True)
    print("ENGINE GPU CHECK", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
