"""The tools on bad input: generate.py (a missing folder, an iteration it does not hold,
--top-k -5, over-long prompts), convert_checkpoint.py from-hf, preprocess_data.py on a full disk:
one line, no traceback, nothing half-written left behind."""

import subprocess
import sys
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from tests.faults.common import MOCK, TINY, on_tiny_disk

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-iteration tiny GPT (NullTokenizer ids, 16 positions) trained in this process."""
    from megazero.training import pretrain
    save = tmp_path_factory.mktemp("gen") / "ck"
    argv = TINY + MOCK + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--save", str(save)]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 0
    return str(save)


def _generate(argv):
    sys.path.insert(0, str(ROOT / "tools"))
    import generate as tool
    return tool.main(argv + ["--max-new-tokens", "2"])


def _error(argv) -> str:
    with pytest.raises(SystemExit) as exc:
        _generate(argv)
    message = str(exc.value.code)
    assert message.startswith("generate.py: error: ") and "\n" not in message, message
    return message[len("generate.py: error: "):]


def test_generate_names_a_missing_folder_and_an_unknown_iteration(checkpoint, tmp_path):
    assert _error(["--load", str(tmp_path / "nope"), "--prompt", "1 2"]) == f"--load {tmp_path}/nope: no such folder"
    assert _error(["--load", checkpoint, "--iteration", "7", "--prompt", "1 2"]) == (
        f"--load {checkpoint} holds no iteration 7 (saved: 2; latest_checkpointed_iteration.txt names the latest)")
    assert len(_generate(["--load", checkpoint, "--iteration", "2", "--prompt", "1 2"])) == 1


def test_generate_refuses_sampling_values_out_of_range(checkpoint, capsys):
    with pytest.raises(SystemExit) as exc:
        _generate(["--load", checkpoint, "--prompt", "1 2", "--top-k", "-5", "--top-p", "0", "--temperature", "-1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err == (
        "generate.py: error: --top-k must be >= 0 (0: no top-k filter), got -5; --top-p must be in (0, 1], got 0.0; "
        "--temperature must be finite and > 0 (or --greedy), got -1.0"), err


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "inf"], "--temperature must be finite and > 0 (or --greedy), got inf"),
    (["--temperature", "nan", "--top-p", "nan"],
     "--top-p must be in (0, 1], got nan; --temperature must be finite and > 0 (or --greedy), got nan")])
def test_generate_refuses_a_temperature_that_is_not_finite(flags, message, capsys):
    """``--temperature inf`` divided every logit to 0: uniform noise, sampled silently."""
    with pytest.raises(SystemExit) as exc:
        _generate(["--load", "unused", "--prompt", "1 2"] + flags)  # refused while parsing, before any load
    assert exc.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == f"generate.py: error: {message}"


def test_generate_starts_an_empty_prompt_from_the_tokenizers_eod_and_says_so(checkpoint, capsys):
    """transformers' generate() without input_ids starts from bos_token_id; NullTokenizer has only an eod (99)."""
    assert len(_generate(["--load", checkpoint, "--prompt", "", "--prompt", "1 2"])) == 2
    assert ("> prompt 1 ('') has no tokens: generating from the tokenizer's EOD token (id 99), as transformers "
            "does without input_ids") in capsys.readouterr().out.splitlines()


def test_an_empty_prompt_without_bos_or_eod_is_refused():
    sys.path.insert(0, str(ROOT / "tools"))
    import generate as tool

    class Tokenizer:  # ids as text; sentencepiece gives -1 for "no BOS", an HF folder without one None
        def __init__(self, bos, eod=None):
            self.bos, self.eod = bos, eod

        def tokenize(self, text):
            return [int(t) for t in text.split()]
    with pytest.raises(ValueError, match=r"^prompt 3 \(' '\) has no tokens and the tokenizer has no BOS or EOD token "
                                         "to start from: give it some text$"):
        tool.tokenize_prompts(Tokenizer(-1), ["5", " "], start=1)
    assert tool.tokenize_prompts(Tokenizer(7, eod=9), ["5", ""], start=0) == (
        [[5], [7]], ["> prompt 2 ('') has no tokens: generating from the tokenizer's BOS token (id 7), as "
                     "transformers does without input_ids"])


def test_generate_names_an_over_long_prompt_and_a_missing_prompt_file(checkpoint, tmp_path, capsys):
    long = " ".join(str(i % 90) for i in range(40))
    assert _error(["--load", checkpoint, "--prompt", "1 2", "--prompt", long]) == (
        f"prompt 2 ({long[:30]!r}...) has 40 tokens; the model takes at most 16 positions "
        "(max_position_embeddings): shorten it")
    with pytest.raises(SystemExit):
        _generate(["--load", checkpoint, "--prompt-file", str(tmp_path / "prompts.txt")])
    assert capsys.readouterr().err.strip().endswith(
        f"generate.py: error: --prompt-file {tmp_path}/prompts.txt: no such file or directory")


def test_generate_from_the_command_line_prints_no_traceback(checkpoint):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--load", checkpoint, "--iteration",
                          "9", "--prompt", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"generate.py: error: --load {checkpoint} holds no iteration 9 (saved: 2; latest_checkpointed_iteration.txt "
        "names the latest)"], out.stderr


def test_from_hf_on_a_folder_that_is_not_a_model(tmp_path, capsys):
    from tests.checkpoint.test_convert_checkpoint import tool
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    argv = ["from-hf", "--hf", str(tmp_path / "notes"), "--save", str(tmp_path / "mz")]
    try:  # as the script: one line, a non-zero status (today: FileNotFoundError)
        code = tool().main(argv)
    except SystemExit as e:
        code = e.code
    message = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code not in (0, None) and "config.json" in message and len(message.splitlines()) == 1, message
    assert not (tmp_path / "mz").exists()


def test_preprocess_on_a_full_disk_leaves_nothing(tmp_path):
    """ENOSPC for real (a 256 KiB tmpfs); tests/faults/test_data.py covers EFBIG everywhere."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join('{"text": "%s"}\n' % " ".join(["7"] * 200) for _ in range(3000)))
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir(), kept.mkdir()
    cmd = on_tiny_disk(str(disk), str(kept), 256, [
        sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(inp), "--output-prefix",
        str(disk / "c"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    if cmd is None:
        pytest.skip("no mount namespace here (not root)")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: {disk}/c_*: no space left on device (ENOSPC: free some space, or write elsewhere)"], out.stderr
    assert list(kept.iterdir()) == []  # no *.tmp-PID, no outputs


def test_preprocess_names_a_missing_input(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "out" / "c"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert tool.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path}/none.jsonl: no such file"]
    assert not (tmp_path / "out").exists()
