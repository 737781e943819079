"""examples/megatron/train_deepseek_v3_distributed.sh: a DeepSeek-V3-style MoE (sigmoid group-limited
routing, expert bias, shared expert, first layer dense) with one MTP layer at TP 2 x EP 2 x PP 2 on 8
CPU ranks trains, logs ``mtp_1 loss`` as Megatron does, saves, and resumes exactly: iterations 4-5
after a restart print the losses of an uninterrupted run."""

import re

from tests.megatron.test_example_scripts import script

LOSSES = re.compile(r" iteration +(\d+)/.*\| lm loss: (\S+) \|.*\| mtp_1 loss: (\S+) \|")


def _losses(out):
    return [LOSSES.search(l).groups() for l in out.stdout.splitlines() if LOSSES.search(l)]


def test_deepseek_v3_script_trains_and_resumes_exactly(tmp_path):
    name = "train_deepseek_v3_distributed.sh"
    out = script(name, tmp_path / "a", 3)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tp 0/2 ep 0/2 dp 0/2 pp 0/2" in out.stdout and "seq_load_balancing_loss:" in out.stdout
    first = _losses(out)
    out = script(name, tmp_path / "a", 5)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded checkpoint" in out.stdout
    resumed = _losses(out)
    out = script(name, tmp_path / "b", 5)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r[0] for r in first + resumed] == ["1", "2", "3", "4", "5"]
    assert first + resumed == _losses(out)
