"""Launch scripts with the flag sets of Megatron-LM's three examples (examples/megatron/): GPT-3,
Llama-3 and Mixtral (every flag; Mixtral at PP 2 x EP 2 on 4 ranks) train, save, resume from the same
--load folder and print Megatron's log line. Also the flag table against --help."""

import os
import re
import subprocess
import sys
from pathlib import Path

from megazero.config.megatron_flags import markdown_table, megatron_flags

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|")


def script(name, *argv, cwd=None, **env):
    out = subprocess.run(["bash", str(ROOT / "examples" / "megatron" / name), *map(str, argv)], capture_output=True,
                         text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=cwd)
    return out, [LINE.match(l).groups() for l in out.stdout.splitlines() if LINE.match(l)]


def test_gpt3_script_trains_saves_and_resumes(tmp_path):
    """Relative paths are the caller's: run from tmp_path, the checkpoints land there, not in the clone."""
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    out, lines = script("train_gpt3_distributed.sh", "ck", "tb", 4, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting from scratch" in out.stdout  # --load ck does not exist yet on the first run
    assert [l[0] for l in lines] == ["1", "2", "3", "4"] and lines[-1][2] == "16"  # 4 samples/iteration (schedule)
    assert ck.is_dir() and tb.is_dir() and not (ROOT / "ck").exists()
    out, lines = script("train_gpt3_distributed.sh", "ck", "tb", 6, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [l[0] for l in lines] == ["5", "6"] and lines[-1][2] == "24"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_llama3_script_trains_saves_and_resumes(tmp_path):
    """All of its flags, --apply-layernorm-1p and --decoupled-lr/--decoupled-min-lr included."""
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    out, lines = script("train_llama3_8b.sh", ck, tb, 24)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Megatron-LM flags with no effect here" in out.stdout and "--manual-gc" in out.stdout
    assert [l[0] for l in lines] == ["1", "2", "3"] and "throughput per GPU" in out.stdout
    assert "decoupled learning rate:" in out.stdout
    out, lines = script("train_llama3_8b.sh", ck, tb, 48)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [l[:3] for l in lines] == [(str(i), "6", str(8 * i)) for i in range(4, 7)]


def test_llama3_script_at_context_parallel_2_trains_and_resumes(tmp_path):
    """Megatron's CP_SIZE=2: the two ranks split each sequence (ring attention), DP 1."""
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    out, lines = script("train_llama3_8b.sh", ck, tb, 24, CP_SIZE="2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cp 0/2 dp 0/1" in out.stdout and [l[0] for l in lines] == ["1", "2", "3"]
    out, lines = script("train_llama3_8b.sh", ck, tb, 48, CP_SIZE="2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [l[:3] for l in lines] == [(str(i), "6", str(8 * i)) for i in range(4, 7)]


def test_mixtral_script_trains_saves_and_resumes(tmp_path):
    """Megatron's Mixtral 8x7B flags, sizes shrunk: 8 experts, top-2, aux loss, alltoall, EP 2 x PP 2 x
    DP 2 on 4 CPU ranks; the second run loads the weights saved at the end of the first (the script
    passes --no-load-optim --no-load-rng, as Megatron's) and goes on from iteration 4."""
    ck = tmp_path / "ck"
    out, lines = script("train_mixtral_8x7b_distributed.sh", ck, 4)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting from scratch" in out.stdout and "ep 0/2" in out.stdout
    assert [l[:3] for l in lines] == [(str(i), "4", str(8 * i)) for i in range(1, 5)]
    assert "load_balancing_loss:" in out.stdout and (ck / "tensorboard").is_dir()
    out, lines = script("train_mixtral_8x7b_distributed.sh", ck, 6)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [l[:3] for l in lines] == [("5", "6", "40"), ("6", "6", "48")]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_flag_table_matches_help_and_docs():
    """Every Megatron flag in the table is in pretrain_gpt.py --help; docs/megatron.md holds the
    table as markdown_table() prints it."""
    help_text = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--help"], capture_output=True,
                               text=True, timeout=60, cwd=ROOT).stdout
    shown = set(re.findall(r"(--[A-Za-z0-9_-]+)", help_text))
    missing = [f.name for f in megatron_flags() if not set(f.options) & shown]
    assert not missing, missing
    assert len(megatron_flags()) > 600 and {f.cls for f in megatron_flags()} == {1, 2, 3}
    assert markdown_table() in (ROOT / "docs" / "megatron.md").read_text()
