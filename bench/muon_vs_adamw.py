"""AdamW vs Muon on the bundled corpus (issue 44): the demo model of examples/train_demo_cpu.sh
(4 layers, hidden 128, 4 heads, seq 128, no dropout, wd 0.1, clip 1.0, cosine to lr/10 after a
warm-up) trained in one process, fp32, the same token budget for each run; a small LR sweep per
optimizer; validation loss every EVAL iterations. Muon with Megatron-LM's defaults (momentum 0.9,
no Nesterov, quintic coefficients, 5 steps, spectral scale, split QKV, bf16 Newton-Schulz); the
same --lr drives AdamW's half (embeddings, output layer, norms, biases).

    PYTHONPATH=. .venv/bin/python bench/muon_vs_adamw.py DATA_DIR [ITERS] [LRS...]
    (DATA_DIR from tools/prepare_demo_data.sh DATA_DIR; prints one line per run and the curves)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def argv(data: str, iters: int, lr: float, optimizer: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
            "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(iters),
            "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters", "8",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", os.environ.get("SEED", "1234"),
            "--data-path", f"{data}/kjv_text_document", "--split", "98,2,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", f"{data}/kjv_sp.model",
            "--log-interval", "10", "--eval-interval", str(max(iters // 4, 1)), "--eval-iters", "4",
            "--distributed-backend", "gloo", "--optimizer", optimizer]


def run(data: str, iters: int, lr: float, optimizer: str) -> dict:
    t0 = time.time()
    out = subprocess.run(argv(data, iters, lr, optimizer), capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    curve = [(int(i), float(v)) for i, v in re.findall(
        r"validation loss at iteration (\d+)[^|\n]*\| lm loss value: ([0-9.Ee+-]+)", out.stdout)]
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    return {"optimizer": optimizer, "lr": lr, "curve": curve, "ms_per_iter": times[-1] if times else None,
            "wall_s": round(time.time() - t0, 1)}


def main():
    data = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    lrs = [float(x) for x in sys.argv[3:]] or [1e-3, 3e-3, 1e-2]  # SEED=... for another seed
    for optimizer in ("adam", "muon"):
        for lr in lrs:
            print(json.dumps(run(data, iters, lr, optimizer)), flush=True)


if __name__ == "__main__":
    main()
