"""Early: everything checkable before any process group is checked while parsing (in-process,
fast), and every problem found is listed in one ``pretrain_gpt.py: error:`` line, exit status 2."""

import os

import pytest

from megazero.arguments import parse_args
from megazero.config.path_checks import check_free_space, checkpoint_bytes
from tests.faults.common import MOCK, TINY

RUN = TINY + ["--train-iters", "2"]


def refused(capsys, argv, world_size=1):
    """The one error line of ``pretrain_gpt.py``'s parse (status 2), without its prefix."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world_size, prog="pretrain_gpt.py", training=True, checks=(check_free_space,))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("pretrain_gpt.py: error: "), err
    return err[len("pretrain_gpt.py: error: "):]


def accepted(argv, world_size=1):
    return parse_args(argv, world_size=world_size, prog="pretrain_gpt.py", training=True, checks=(check_free_space,))


def _dataset(prefix):
    for suffix in (".bin", ".idx"):
        open(prefix + suffix, "wb").close()
    return prefix


def test_every_problem_is_listed_in_one_line(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    argv = ["--num-layers", "2", "--hidden-size", "31", "--num-attention-heads", "4", "--seq-length", "15",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--lr", "-1", "--log-interval", "0",
            "--save", str(tmp_path / "file"), "--data-path", str(tmp_path / "nope"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json")]
    problems = refused(capsys, argv, world_size=2).split("; ")
    expected = ["--log-interval must be >= 1, got 0", "--lr must be >= 0, got -1.0",
                "--hidden-size 31 is not divisible by --tensor-model-parallel-size 2",
                "--hidden-size 31 is not divisible by --num-attention-heads 4",
                "--sequence-parallel needs --seq-length 15 divisible by --tensor-model-parallel-size 2",
                "--micro-batch-size is required", "one of --train-iters or --train-samples is required",
                f"--save {tmp_path}/file: is a file, not a folder",
                f"--data-path {tmp_path}/nope: no such dataset", "--tokenizer-type GPT2BPETokenizer needs --merge-file",
                f"--vocab-file {tmp_path}/vocab.json: no such file"]
    for text in expected:
        assert any(p.startswith(text) for p in problems), (text, problems)
    assert len(problems) == len(expected), problems


@pytest.mark.parametrize("drop", ["--lr", "--train-iters", "--seq-length", "--num-layers", "--hidden-size",
                                  "--num-attention-heads", "--micro-batch-size"])
def test_missing_required_value_is_named(capsys, drop):
    argv = RUN + MOCK
    i = argv.index(drop)
    message = refused(capsys, argv[:i] + argv[i + 2:])
    assert drop in message and "required" in message, message


def test_missing_global_batch_size_is_megatrons_default():
    argv = RUN + MOCK
    i = argv.index("--global-batch-size")
    assert accepted(argv[:i] + argv[i + 2:], world_size=1).global_batch_size == 2  # micro-batch x DP


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--train-iters", "-5"], "--train-iters must be >= 1, got -5"),
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0"),
])
def test_impossible_value_is_named(capsys, extra, message):
    assert message in refused(capsys, RUN + MOCK + extra)


def test_synthetic_data_must_be_asked_for(capsys, tmp_path):
    assert refused(capsys, RUN).startswith("no training data: give --data-path PREFIX")
    assert refused(capsys, RUN + ["--mock-data"]) == "--mock-data needs --vocab-size (the synthetic tokens' vocabulary)"
    missing = tmp_path / "list.txt"
    message = refused(capsys, RUN + ["--data-args-path", str(missing)])
    assert message.startswith(f"--data-args-path {missing}: no such file; no training data"), message


def test_save_must_be_a_writable_folder(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert refused(capsys, RUN + MOCK + ["--save", "/proc/megazero-ck"]) == (
        "--save /proc/megazero-ck: is on the pseudo file system /proc, where no file can be written")
    assert refused(capsys, RUN + MOCK + ["--tensorboard-dir", str(tmp_path / "file"), "--data-cache-path",
                                         str(tmp_path / "file")]) == (
        f"--tensorboard-dir {tmp_path}/file: is a file, not a folder; --data-cache-path {tmp_path}/file: is a file, "
        "not a folder")
    assert refused(capsys, RUN + MOCK + ["--save", str(tmp_path / "file" / "ck")]) == (
        f"--save {tmp_path}/file/ck: {tmp_path}/file is a file, so the folder cannot be created")
    assert accepted(RUN + MOCK + ["--save", str(tmp_path / "new" / "deep")]).save  # creatable: fine
    assert not (tmp_path / "new").exists()  # and nothing created while parsing
    if os.geteuid() != 0:  # root may write into a read-only folder
        (tmp_path / "ro").mkdir(mode=0o500)
        assert "not writable: permission denied" in refused(capsys, RUN + MOCK + ["--save", str(tmp_path / "ro" / "ck")])


def test_load_data_and_tokenizer_paths(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert refused(capsys, RUN + MOCK + ["--load", str(tmp_path / "file")]) == f"--load {tmp_path}/file is not a directory"
    accepted(RUN + MOCK + ["--load", str(tmp_path / "not-yet")])  # Megatron's first run of a requeue script
    prefix = _dataset(str(tmp_path / "d"))
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    accepted(RUN + null + ["--data-path", "0.7", prefix, "0.3", prefix])
    assert refused(capsys, RUN + null + ["--data-path", prefix, "--split", "abc"]) == (
        "--split 'abc': expected up to three finite non-negative weights such as 969,30,1")
    os.remove(prefix + ".bin")
    assert refused(capsys, RUN + null + ["--data-path", prefix]) == f"--data-path {prefix}.bin: no such file"
    _dataset(prefix)
    assert refused(capsys, RUN + null + ["--data-path", prefix + ".bin"]) == (
        f"--data-path {prefix}.bin: no such dataset ({prefix}.bin.bin and {prefix}.bin.idx missing) "
        f"(give the prefix {prefix}, without .bin)")
    assert refused(capsys, RUN + null + ["--train-data-path", prefix, "--valid-data-path", str(tmp_path / "v")]) == (
        f"--valid-data-path {tmp_path}/v: no such dataset ({tmp_path}/v.bin and {tmp_path}/v.idx missing)")
    assert refused(capsys, RUN + ["--data-path", prefix, "--tokenizer-type", "Llama2Tokenizer"]) == (
        "--tokenizer-type Llama2Tokenizer needs --tokenizer-model")
    assert refused(capsys, RUN + ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer",
                                  "--tokenizer-model", str(tmp_path)]) == f"--tokenizer-model {tmp_path}: is a folder, not a file"
    accepted(RUN + ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)])


def test_sequence_parallel_needs_the_sequence_divisible_by_tp(capsys):
    argv = RUN + MOCK + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert accepted(argv, world_size=2).sequence_parallel
    assert refused(capsys, argv + ["--seq-length", "15", "--max-position-embeddings", "16"], world_size=2) == (
        "--sequence-parallel needs --seq-length 15 divisible by --tensor-model-parallel-size 2")


def test_free_space_for_one_checkpoint(capsys, tmp_path):
    """A 175B-parameter GPT-3 shape cannot fit a checkpoint on this disk (2.5 TiB in fp32); the
    estimate is (p + 12) x Φ bytes, p Φ without the optimizer state."""
    gpt3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--max-position-embeddings", "2048"]
    message = refused(capsys, RUN + MOCK + gpt3 + ["--save", str(tmp_path / "ck")])
    assert message.startswith(f"--save {tmp_path}/ck: no space left on device for one checkpoint: "), message
    # 96 layers x (12 h^2 + 9 h biases + 4 h norms) + 128 x h (vocabulary 100 padded) + 2048 x h + 2 h
    assert message.endswith("GiB (16 bytes x 173,988,274,176 parameters)"), message
    args = accepted(RUN + MOCK + ["--save", str(tmp_path / "ck"), "--bf16"])
    need, phi = checkpoint_bytes(args)
    assert need == 14 * phi and checkpoint_bytes(args.replace(no_save_optim=True))[0] == 2 * phi
