"""examples/qwen3/train_qwen3.sh (Megatron's flag names, --qk-layernorm, TP 2 with SP x DP 2, the
distributed optimizer, bf16) trains, saves and resumes from the same folder; the checkpoint
records the new model flags, so a resume with another --window-size is refused before any work
naming it; the trained checkpoint exports as Qwen3ForCausalLM, which transformers loads with
megazero's logits."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from megazero.checkpoint.reader import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|")


def _run(ck, iters, **env):
    out = subprocess.run(["bash", str(ROOT / "examples" / "qwen3" / "train_qwen3.sh"), str(ck), str(iters)],
                         capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    return out, [LINE.match(l).groups() for l in out.stdout.splitlines() if LINE.match(l)]


def test_qwen3_script_trains_resumes_refuses_another_window_and_exports(tmp_path):
    ck = tmp_path / "ck"
    out, lines = _run(ck, 4)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting from scratch" in out.stdout and "tp 0/2 dp 0/2" in out.stdout
    assert [l[:3] for l in lines] == [(str(i), "4", str(8 * i)) for i in range(1, 5)]
    args = CheckpointReader(str(ck)).args
    assert args["qk_layernorm"] is True and args["window_size"] is None and args["kv_channels"] == 32
    out, lines = _run(ck, 6, WINDOW_SIZE="15")
    assert out.returncode != 0 and "--window-size: command line [15, 0], checkpoint None" in out.stderr + out.stdout
    out, lines = _run(ck, 6)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded checkpoint" in out.stdout and [l[:3] for l in lines] == [("5", "6", "40"), ("6", "6", "48")]
    transformers = pytest.importorskip("transformers")
    from megazero.model import GPTConfig, GPTModel
    from tests.checkpoint.test_convert_checkpoint import tool
    tool().to_hf(str(ck), str(tmp_path / "hf"))  # the fp32 master weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reader = CheckpointReader(str(ck))  # megazero's forward in fp32 on the same master weights
    ours = GPTModel(GPTConfig.from_saved_args(reader.args, params_dtype=torch.float32), None).eval()
    ours.load_full_state_dict(reader.full_model_state_dict(kind="master"), strict=False)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)[..., :256]
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5
