"""Loss equivalence of ``megazero.initialize`` with one-process ``torch.optim.AdamW`` and with
DeepSpeed's ``deepspeed.initialize`` (same ds_config, when importable; see bench/zero_stage3.py):
tiny random RobertaForMaskedLM and GPT2LMHeadModel, fp32, ZeRO 1/2/3 over DP 2, gradient
accumulation 2, clipping 0.3, Hugging Face's two param groups, 3 optimizer steps. Prints the
largest relative difference of any micro-batch loss per (model, stage).

    PYTHONPATH=. .venv/bin/python bench/engine_equivalence.py
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.getcwd())
from bench.zero_stage3 import _deepspeed_available  # noqa: E402
from megazero.testing import run_distributed  # noqa: E402
from tests.engine.hf_tiny import BETAS, CLIP, EPS, LR, MICRO, batches, build, groups, reference  # noqa: E402

GAS, STEPS = 2, 3


def config(stage: int, system: str) -> dict:
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS}
    if system == "deepspeed":
        params["torch_adam"] = True
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero}


def worker(rank, world, system, kind, stage, data):
    warnings.filterwarnings("ignore")
    model = build(kind)
    if system == "megazero":
        import megazero
        engine = megazero.initialize(model=model, model_parameters=groups(model), config=config(stage, system))[0]
    else:
        import deepspeed
        import torch.distributed as dist
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
        deepspeed.init_distributed(dist_backend="gloo")
        engine = deepspeed.initialize(model=model, model_parameters=groups(model), config=config(stage, system))[0]
        assert dist.get_world_size() == world
    out = []
    for step in data:
        for ids, labels in step[rank]:
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
    return out


def main():
    systems = ["megazero"] + (["deepspeed"] if _deepspeed_available() else [])
    print(f"{'model':8} {'stage':>5} " + " ".join(f"{s + ' vs torch':>20}" for s in systems)
          + ("   megazero vs deepspeed" if len(systems) == 2 else ""))
    for kind in ("roberta", "gpt2"):
        data = batches(kind, STEPS, 2, GAS)
        ref, _ = reference(kind, data)
        for stage in (1, 2, 3):
            got = {s: run_distributed(worker, 2, s, kind, stage, data, timeout_s=600) for s in systems}
            want = [[v for it in range(STEPS) for v in ref[it][r]] for r in range(2)]
            diff = {s: max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(got[s][r], want[r])) for s in systems}
            line = f"{kind:8} {stage:>5} " + " ".join(f"{diff[s]:20.2e}" for s in systems)
            if len(systems) == 2:
                md = max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(got["megazero"][r], got["deepspeed"][r]))
                line += f"   {md:.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
