"""--rampup-batch-size through pretrain_gpt.py (Megatron-LM core_v0.17.1 semantics): the batch sizes,
consumed samples and learning rates of a hand-worked ramp, and a run stopped mid-ramp and resumed
from its checkpoint prints the same lines (batch size, LR, loss) as the uninterrupted run."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24",
        "--train-samples", "40", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-samples", "8",
        "--lr-decay-style", "linear", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
        "--mock-data", "--vocab-size", "100", "--seed", "3", "--log-interval", "1", "--use-distributed-optimizer",
        "--log-params-norm", "--log-num-zeros-in-grad"]
LINE = re.compile(r"^ \[[^]]+\] iteration +(\d+)/ +(\d+) \|")


def run(flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0")
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, *flags], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, {int(LINE.match(l).group(1)): l for l in out.stdout.splitlines() if LINE.match(l)}


def field(line, name):
    m = re.search(rf"\| {name}: +([^|]+) \|", "|" + line)
    return None if m is None else m.group(1).strip()


def megatron_lr(samples, lr=1e-2, min_lr=1e-3, warmup=8, decay=40):
    """OptimizerParamScheduler.get_lr: linear warm-up from 0 over 8 samples, linear decay to 40."""
    if samples <= warmup:
        return lr * samples / warmup
    return min_lr + (1 - (samples - warmup) / (decay - warmup)) * (lr - min_lr)


def test_rampup_by_hand_and_resumed_mid_ramp_equals_uninterrupted(tmp_path):
    """S=2, I=2, R=24, G=8: r = 24 / 3 = 8 samples per increment, B(c) = 2 + int(c / 8) * 2 while
    c <= 24: c = 0, 2, 4, 6 -> 2; 8, 12 -> 4; 16, 22 -> 6; 28 > 24 -> 8. update_train_iters(40):
    8 ramp iterations reach 28, then (40 - 28) // 8 = 1: 9 iterations, consumed 40 - 4 = 36."""
    stdout, full = run([])
    assert "batch-size ramp-up honoured as in Megatron-LM core_v0.17.1" in stdout
    sizes = [2, 2, 2, 2, 4, 4, 6, 6, 8]
    consumed = [sum(sizes[:i + 1]) for i in range(9)]
    assert sorted(full) == list(range(1, 10)) and all(f"/{9:8d} |" in l for l in full.values())
    for i, line in full.items():
        assert field(line, "global batch size") == str(sizes[i - 1])
        assert field(line, "consumed samples") == str(consumed[i - 1])
        assert float(field(line, "learning rate")) == float(f"{megatron_lr(consumed[i - 1]):.6E}")
    ck = tmp_path / "ck"
    _, first = run(["--save", str(ck), "--exit-interval", "5"])  # stops after 12 samples, mid-ramp
    assert sorted(first) == [1, 2, 3, 4, 5] and (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    _, resumed = run(["--save", str(ck), "--load", str(ck)])
    assert sorted(resumed) == [6, 7, 8, 9]
    for i in range(1, 10):
        line = first.get(i, resumed.get(i))
        for name in ("consumed samples", "global batch size", "learning rate", "lm loss", "grad norm", "num zeros",
                     "params norm"):
            assert field(line, name) == field(full[i], name) is not None, (i, name)
