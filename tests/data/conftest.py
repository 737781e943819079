"""Fixtures for the data-pipeline tests: a small corpus, a sentencepiece model, GPT-2 files."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KJV = os.path.join(ROOT, "data", "kjv.jsonl.gz")

# Text that exercises unicode, whitespace and contractions, mixed into the small corpus.
TRICKY = [
    "Hello world! It's John's book; we'll see, they'd say, I'm sure you're right, we've won.",
    "café naïve résumé Ωμέγα Привет мир  العربية  日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 🇫🇷 ❤️ family 👨‍👩‍👧 end",
    "  leading spaces,   runs   of spaces,\ttabs\t\tand\n\nnewlines \n trailing   ",
    "numbers 12345 3.14159 1,000,000 ١٢٣ Ⅻ ² and symbols @#$%^&*() -- ... !!",
    "'s 'S 'll 'LL 'd 're 've 'm 't don't DON'T o'clock rock'n'roll",
    "nbsp\u00a0thin\u2009zero\u200bwidth soft\u00adhyphen \r\n crlf",
]


def kjv_texts(limit=None):
    with gzip.open(KJV, "rt", encoding="utf-8") as f:
        out = [json.loads(line)["text"] for line in f]
    return out[:limit] if limit else out


def run_tool(script: str, *args: str):
    """Run tools/<script> in a subprocess; returns CompletedProcess (text, captured)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="session")
def tool():
    """run_tool(script, *args) -> CompletedProcess."""
    return run_tool


@pytest.fixture(scope="session")
def tricky():
    return list(TRICKY)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A JSONL file: 40 KJV chapters plus the tricky strings, keys 'text' and 'title'."""
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    docs = kjv_texts(40) + TRICKY + [""]
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"id": i, "text": text, "title": f"doc {i}"}) + "\n")
    return str(path), docs


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, small_corpus):
    """A sentencepiece model (vocab 600) trained by tools/train_tokenizer.py."""
    prefix = tmp_path_factory.mktemp("sp") / "tok"
    r = run_tool("train_tokenizer.py", "--input", small_corpus[0], "--json-keys", "text",
                 "--vocab-size", "600", "--output-prefix", str(prefix))
    assert r.returncode == 0, r.stderr
    return str(prefix) + ".model"


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """vocab.json / merges.txt of a byte-level BPE (600 merges) trained on KJV + TRICKY."""
    from megazero.data.bpe_trainer import train_byte_level_bpe, write_gpt2_files

    d = tmp_path_factory.mktemp("gpt2")
    vocab, merges = train_byte_level_bpe(kjv_texts(120) + TRICKY * 20, num_merges=600)
    write_gpt2_files(vocab, merges, str(d / "vocab.json"), str(d / "merges.txt"))
    return str(d / "vocab.json"), str(d / "merges.txt")
