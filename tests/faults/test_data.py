"""Nothing silent, early: bad data gets one line naming the file (document, id) and the cause."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megazero.data.data_checks import check_ids
from megazero.data.gpt_dataset import build_train_valid_test_datasets
from megazero.data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetBuilder
from tests.faults.common import TINY

ROOT = Path(__file__).resolve().parents[2]


def _dataset(prefix: str, docs, dtype=np.uint16) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return prefix


def _docs(n=20, length=30, bad=None):
    docs = [list((np.arange(length) + d) % 100) for d in range(n)]
    if bad is not None:
        docs[bad[0]][5] = bad[1]
    return docs


def _build(prefix, vocab_size=100, **kw):
    return build_train_valid_test_datasets([prefix], "1,0,0", 16, 1, (8, 0, 0), vocab_size=vocab_size, **kw)


def test_token_id_outside_vocabulary_named_at_build(tmp_path):
    prefix = _dataset(str(tmp_path / "d"), _docs(bad=(7, 150)))
    with pytest.raises(DataError, match=r"d: document 7 \(sequence 7\) holds token id 150, outside the vocabulary of 100"):
        _build(prefix)
    train = _build(prefix, vocab_size=None)[0]  # unchecked build, then per sample
    train.vocab_size = 100
    with pytest.raises(DataError, match="document 7 .* token id 150"):
        for i in range(len(train)):
            train[i]


def test_per_sample_check_costs_microseconds():
    tokens = np.random.default_rng(0).integers(0, 50000, 4097)
    seqs = [(0, 4097)]
    t0 = time.perf_counter()
    for _ in range(2000):
        check_ids(tokens, 50257, None, sequences=seqs)
    per_call = (time.perf_counter() - t0) / 2000
    print(f"check_ids on 4097 tokens: {per_call * 1e6:.1f} us")
    assert per_call < 200e-6  # ~2-10 us on a loaded machine; reading the sample costs more


def test_missing_corrupt_and_mistyped_files_named(tmp_path):
    prefix = _dataset(str(tmp_path / "d"), _docs())
    with pytest.raises(DataError, match=r"nope\.idx: no such file"):
        IndexedDataset(str(tmp_path / "nope"))
    raw = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(raw[:17] + bytes([4]) + raw[18:])  # dtype code: int32
    with pytest.raises(DataError, match=r"d\.idx: sequence pointers .*fit 2-byte tokens, not 4-byte int32: a changed dtype code"):
        IndexedDataset(prefix)
    Path(prefix + ".idx").write_bytes(b"garbage" + raw[7:])
    with pytest.raises(DataError, match=r"d\.idx: wrong magic"):
        IndexedDataset(prefix)
    Path(prefix + ".idx").write_bytes(raw)
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-10])
    with pytest.raises(DataError, match=r"d\.bin: truncated"):
        IndexedDataset(prefix)


def test_empty_dataset_named(tmp_path):
    prefix = _dataset(str(tmp_path / "e"), [])
    with pytest.raises(DataError, match=r"e\.bin/\.idx: the dataset is empty \(0 documents"):
        _build(prefix)


def test_index_cache_problems_named(tmp_path):
    prefix = _dataset(str(tmp_path / "d"), _docs())
    (tmp_path / "cachefile").write_text("x")
    with pytest.raises(DataError, match="cachefile .*is a file"):
        _build(prefix, cache_dir=str(tmp_path / "cachefile"))
    _build(prefix, cache_dir=str(tmp_path / "cache"))
    npy = sorted((tmp_path / "cache").glob("*-sample.npy"))[0]
    npy.write_bytes(npy.read_bytes()[:100])
    with pytest.raises(DataError, match=rf"{npy.name} cannot be read .*delete it"):
        _build(prefix, cache_dir=str(tmp_path / "cache"))


def _preprocess(tmp_path, text, *pre):
    inp = tmp_path / "in.jsonl"
    inp.write_text(text)
    cmd = [sys.executable, *pre, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(inp), "--output-prefix",
           str(tmp_path / "out" / "c"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_preprocess_empty_input_is_an_error(tmp_path):
    r = _preprocess(tmp_path, "\n\n")
    assert r.returncode == 1 and "no documents" in r.stderr and "Traceback" not in r.stderr
    assert not list((tmp_path / "out").iterdir())


def test_preprocess_write_failure_leaves_nothing(tmp_path):
    """A full disk, simulated by a 4 KiB file-size limit (EFBIG instead of ENOSPC)."""
    limit = ("-c", "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    lines = "".join('{"text": "%s"}\n' % " ".join(["7"] * 50) for _ in range(200))
    r = _preprocess(tmp_path, lines, *limit)
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "out").iterdir())


def test_pretrain_data_error_is_one_line(tmp_path):
    """A missing dataset is named while parsing (exit 2); a corrupt one when it is opened (exit 1)."""
    prefix = _dataset(str(tmp_path / "d"), _docs())
    raw = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(b"garbage" + raw[7:])
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "2", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "100", "--data-path", prefix, "--split", "1,0,0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"rank 0: data error: {prefix}.idx: wrong magic")


def test_preprocess_untokenizable_line_named_and_skippable(tmp_path):
    text = '{"text": "1 2 3"}\n{"text": "4 x 5"}\n{"text": "6"}\n'
    r = _preprocess(tmp_path, text)
    assert r.returncode == 1 and "in.jsonl:2: cannot be tokenized" in r.stderr and "Traceback" not in r.stderr
    inp = str(tmp_path / "in.jsonl")
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", inp, "--output-prefix",
           str(tmp_path / "out" / "c"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--skip-bad-lines"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "1 bad lines skipped" in r.stderr
    assert IndexedDataset(str(tmp_path / "out" / "c_text_document")).num_documents == 2


def test_bad_split_named():
    from megazero.data.gpt_dataset import parse_split
    with pytest.raises(DataError, match="--split 'abc': expected up to three"):
        parse_split("abc")
