"""tools/preprocess_data.py: token-exact output, workers, bad lines, atomic outputs."""
import gzip
import json
import os
import shutil

import numpy as np
import pytest

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizers import GPT2BPETokenizer, SentencePieceTokenizer


def _sp_args(inp, prefix, model, *extra):
    return ["--input", inp, "--output-prefix", prefix, "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", model, *extra]


def test_sentencepiece_read_back_token_exact(tool, tmp_path, small_corpus, sp_model):
    path, docs = small_corpus
    prefix = str(tmp_path / "out")
    r = tool("preprocess_data.py", *_sp_args(path, prefix, sp_model, "--append-eod",
                                                 "--json-keys", "text", "title",
                                                 "--log-interval", "10"))
    assert r.returncode == 0, r.stderr
    assert "Processed 40 documents" in r.stderr and "MB/s" in r.stderr
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(docs)
    expected = [tok.tokenize(t) + [tok.eod] for t in docs if t]   # "" has no sequence
    assert len(ds) == len(expected)
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert ds.document_indices[-2] == ds.document_indices[-1]  # the empty document
    titles = IndexedDataset(prefix + "_title_document")
    assert titles[3].tolist() == tok.tokenize("doc 3") + [tok.eod]


def test_workers_and_gzip_give_identical_files(tool, tmp_path, small_corpus, sp_model, gpt2_files):
    path, _ = small_corpus
    gz = str(tmp_path / "in.jsonl.gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
            "--merge-file", gpt2_files[1], "--append-eod"]
    outs = []
    for name, inp, workers in [("a", path, "1"), ("b", gz, "2"), ("c", path, "3")]:
        prefix = str(tmp_path / name)
        r = tool("preprocess_data.py", "--input", inp, "--output-prefix", prefix,
                     "--workers", workers, *gpt2)
        assert r.returncode == 0, r.stderr
        outs.append([open(prefix + "_text_document" + e, "rb").read() for e in (".bin", ".idx")])
    assert outs[0] == outs[1] == outs[2]
    tok = GPT2BPETokenizer(*gpt2_files)
    ds = IndexedDataset(str(tmp_path / "a_text_document"))
    assert ds[41].tolist() == tok.tokenize(small_corpus[1][41]) + [tok.eod]


def test_null_tokenizer(tool, tmp_path):
    inp = tmp_path / "ids.jsonl"
    inp.write_text("\n".join(json.dumps({"text": t}) for t in ["1 2 3", "70000 5", ""]) + "\n")
    prefix = str(tmp_path / "n")
    r = tool("preprocess_data.py", "--input", str(inp), "--output-prefix", prefix,
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000", "--append-eod")
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.int32  # vocab >= 65500
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3, 99999], [70000, 5, 99999]]


def _bad_input(tmp_path, bad_line, where=3):
    lines = [json.dumps({"text": f"line number {i}"}) for i in range(1, 7)]
    lines[where - 1] = bad_line
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "unterminated', "not valid JSON"),
    ('{"body": "no text key"}', "missing key 'text'"),
    ('{"text": 42}', "value of 'text' is int, not a string"),
    ('["a", "list"]', "expected a JSON object"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_line_fails_naming_file_and_line_and_leaves_nothing(tool, tmp_path, sp_model, bad_line,
                                                                message, workers):
    inp = _bad_input(tmp_path, bad_line)
    out_dir = tmp_path / "out"
    r = tool("preprocess_data.py", *_sp_args(inp, str(out_dir / "ds"), sp_model,
                                                 "--workers", workers))
    assert r.returncode == 1
    assert f"{inp}:3: {message}" in r.stderr
    assert os.listdir(out_dir) == []  # no output, no temporary files


def test_skip_bad_lines(tool, tmp_path, sp_model):
    inp = _bad_input(tmp_path, "not json at all")
    with open(inp, "a") as f:
        f.write('{"nope": 1}\n\n   \n' + json.dumps({"text": "last"}) + "\n")
    prefix = str(tmp_path / "ds")
    r = tool("preprocess_data.py", *_sp_args(inp, prefix, sp_model, "--skip-bad-lines"))
    assert r.returncode == 0, r.stderr
    assert f"skipping {inp}:3" in r.stderr and f"skipping {inp}:7" in r.stderr
    assert "2 bad lines skipped" in r.stderr
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(prefix + "_text_document")
    texts = [f"line number {i}" for i in (1, 2, 4, 5, 6)] + ["last"]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) for t in texts]


def test_failed_run_keeps_previous_output(tool, tmp_path, sp_model):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n")
    prefix = str(tmp_path / "ds")
    assert tool("preprocess_data.py", *_sp_args(str(good), prefix, sp_model)).returncode == 0
    before = open(prefix + "_text_document.bin", "rb").read()
    r = tool("preprocess_data.py", *_sp_args(_bad_input(tmp_path, "{"), prefix, sp_model))
    assert r.returncode == 1
    assert open(prefix + "_text_document.bin", "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "ds_text_document.bin",
                                            "ds_text_document.idx", "good.jsonl"]


def test_missing_tokenizer_flag(tool, tmp_path):
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"text": "a"}\n')
    r = tool("preprocess_data.py", "--input", str(inp), "--output-prefix",
                 str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer")
    assert r.returncode != 0 and "--vocab-file" in r.stderr
