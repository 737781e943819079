"""examples/megatron/train_deepseek_v3_distributed.sh: a DeepSeek-V3-style model (MLA, sigmoid group-limited
routing, expert bias, shared expert, first layer dense) with one MTP layer at TP 2 x EP 2 x PP 2 on 8
CPU ranks trains, logs ``mtp_1 loss`` as Megatron does, saves, and resumes exactly: restarted from
its iteration-3 checkpoint, iterations 4-5 print the losses of the uninterrupted run."""

import re
import shutil

from tests.megatron.test_example_scripts import script

LOSSES = re.compile(r" iteration +(\d+)/.*\| lm loss: (\S+) \|.*\| mtp_1 loss: (\S+) \|")


def _losses(out):
    return [LOSSES.search(l).groups() for l in out.stdout.splitlines() if LOSSES.search(l)]


def test_deepseek_v3_script_trains_and_resumes_exactly(tmp_path):
    name, a, b = "train_deepseek_v3_distributed.sh", tmp_path / "a", tmp_path / "b"
    out = script(name, a, 5)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tp 0/2 ep 0/2 dp 0/2 pp 0/2" in out.stdout and "seq_load_balancing_loss:" in out.stdout
    straight = _losses(out)
    assert [r[0] for r in straight] == ["1", "2", "3", "4", "5"]
    shutil.copytree(a, b)  # the run as it stood after iteration 3 (--save-interval 3)
    shutil.rmtree(b / "iter_0000005")
    (b / "latest_checkpointed_iteration.txt").write_text("3")
    out = script(name, b, 5)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded checkpoint" in out.stdout and _losses(out) == straight[3:]
