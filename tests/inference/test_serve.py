"""The REST server: Megatron's API over real HTTP at TP 1 and 2, greedy answers equal to
tools/generate.py's, Megatron's 400 messages, concurrent requests batched, SIGTERM drains."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megazero.inference.serving import Batcher, RequestError, parse_request
from megazero.testing import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["1 2 3", "40 41 42 43 44 45", "7", "9 9 9 9"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.inference.test_generate import _train_tiny
    save = str(tmp_path_factory.mktemp("serve") / "ckpt")
    train = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2", "--train-iters", "1",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--distributed-backend",
             "gloo", "--mock-data", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
             "--save", save, "--init-method-std", "0.3"]
    run_distributed(_train_tiny, 1, train, timeout_s=120)
    return save


def put(port, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start(ckpt, tp, *extra):
    port = free_port()
    cmd = [sys.executable, str(ROOT / "tools/run_text_generation_server.py"), "--load", ckpt, "--port", str(port),
           "--tensor-model-parallel-size", str(tp), "--num-threads", "1", *extra]
    if tp > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port", str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                health = json.loads(r.read())
                assert health["status"] == "ok"
                proc.rank0_pid = health["pid"]
                return proc, port
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start:\n" + proc.communicate()[0])


def stop(proc):
    """SIGTERM rank 0 (torchrun would turn its own SIGTERM into a failure): it drains and tells
    the other ranks to stop."""
    os.kill(proc.rank0_pid, signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def reference(ckpt):
    """tools/generate.py's greedy completions of PROMPTS (8 new tokens)."""
    from tests.inference.test_generate import _run_tool
    return run_distributed(_run_tool, 1, ["--load", ckpt, "--max-new-tokens", "8", "--batch-size", "1"]
                           + [a for p in PROMPTS for a in ("--prompt", p)], timeout_s=60)[0]


def _checks(port, reference):
    status, body = put(port, {"prompts": PROMPTS, "tokens_to_generate": 8, "top_k": 1, "logprobs": True})
    assert status == 200, body
    assert body["text"] == [p + c for p, c in zip(PROMPTS, reference)]
    assert [len(lp) for lp in body["logprobs"]] == [len(t) - 1 for t in body["tokens"]]
    assert all(lp <= 0 for row in body["logprobs"] for lp in row)
    assert [len(s) for s in body["segments"]] == [len(t) for t in body["tokens"]]
    # concurrent single-prompt requests: batched, the same answers
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, put(port, {"prompts": [PROMPTS[i % 4]], "tokens_to_generate": 4 + i % 3, "top_k": 1})))
        for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        health = json.loads(r.read())
    assert health["batches"] < health["requests"], f"no concurrent requests were batched: {health}"
    for i in range(8):
        status, body = results[i]
        assert status == 200, body
        assert len(body["tokens"][0]) <= len(PROMPTS[i % 4].split()) + 4 + i % 3
        assert reference[i % 4].startswith(body["text"][0][len(PROMPTS[i % 4]):])


@pytest.mark.parametrize("tp", [1, 2])
def test_server_answers_like_generate_py(ckpt, reference, tp):
    proc, port = start(ckpt, tp)
    try:
        _checks(port, reference)
        assert put(port, None, raw=b"{not json")[0] == 400
        assert put(port, {"prompts": ["1"], "tokens_to_generate": -1}) == (
            400, {"message": "tokens_to_generate must be an integer greater than or equal to 0"})
        status, body = put(port, {"prompts": ["1 2"], "tokens_to_generate": 10 ** 9})
        assert status == 400 and body["message"].startswith("Maximum allowed sequence length was set to")
        sampled = put(port, {"prompts": ["1 2"], "tokens_to_generate": 6, "top_k": 5, "random_seed": 3})
        assert sampled == put(port, {"prompts": ["1 2"], "tokens_to_generate": 6, "top_k": 5, "random_seed": 3})
        cli = subprocess.run([sys.executable, str(ROOT / "tools/text_generation_cli.py"), f"127.0.0.1:{port}"],
                             input="1 2 3\n8\n5\n-1\n", capture_output=True, text=True, timeout=60)
        assert "Megatron Response: \n1 2 3" in cli.stdout, cli.stdout + cli.stderr
        assert "Error 400: tokens_to_generate must be an integer greater than or equal to 0" in cli.stdout
    finally:
        out = stop(proc) if proc.poll() is None else proc.communicate()[0]
    assert "> server stopped" in out


def test_validation_uses_megatron_messages():
    tok = [int(x) for x in "1".split()]

    def bad(body):
        with pytest.raises(RequestError) as e:
            parse_request(body, lambda s: [int(x) for x in s.split()], 99, 16)
        return str(e.value)

    assert tok == [1]
    assert bad([1]) == bad({}) == "prompts argument required"
    assert bad({"prompts": "x"}) == "prompts is not a list of strings"
    assert bad({"prompts": []}) == "prompts is empty"
    assert bad({"prompts": ["1"] * 129}) == "Maximum number of prompts is 128"
    assert bad({"prompts": ["1"], "max_len": 3}) == "max_len is no longer used.  Replace with tokens_to_generate"
    assert bad({"prompts": ["1"], "tokens_to_generate": "3"}) == "tokens_to_generate must be an integer greater than 0"
    assert bad({"prompts": ["1"], "tokens_to_generate": 0}) == "tokens_to_generate=0 implies logprobs should be True"
    assert bad({"prompts": ["1"], "temperature": 0}).startswith("temperature must be a positive number")
    assert bad({"prompts": ["1"], "top_k": 1001}).startswith("top_k must be equal to or greater than 0")
    assert bad({"prompts": ["1"], "top_k": 2, "top_p": 0.5}) == "cannot set both top-k and top-p samplings."
    assert bad({"prompts": ["1"], "top_p": 1}) == "top_p must be a positive float less than or equal to 1.0"
    assert bad({"prompts": [""]}) == "Empty prompts require add_BOS=true"
    assert bad({"prompts": ["1"], "stop_on_eol": 1}) == "stop_on_eol must be a boolean value"
    assert bad({"prompts": ["1"], "random_seed": -2}) == "random_seed must be a positive integer"
    assert bad({"prompts": ["1 2 3"], "tokens_to_generate": 14}) == (
        "Maximum allowed sequence length was set to 16 tokens but requested generation of 17 tokens")
    r = parse_request({"prompts": [""], "add_BOS": True, "tokens_to_generate": 3}, str.split, 99, 16)
    assert r.ids == [[99]]


def test_batcher_groups_bounds_and_drops_cancelled():
    def req(top_k=1, n=1, seed=-1):
        return parse_request({"prompts": ["1"] * n, "top_k": top_k, "random_seed": seed} if seed >= 0 else
                             {"prompts": ["1"] * n, "top_k": top_k}, lambda s: [1], 99, 128)

    b = Batcher(max_queue=5, max_rows=4, wait_s=0.0)
    jobs = [b.submit(req()), b.submit(req(top_k=5)), b.submit(req(n=2)), b.submit(req(top_k=5, seed=1)),
            b.submit(req(n=2))]
    assert b.submit(req()) is None  # full: 503
    assert b.next_batch(0.01) == [jobs[0], jobs[2]]  # greedy, 3 rows; the next greedy job would make 5
    jobs[1].cancelled = True
    assert b.next_batch(0.01) == [jobs[3]]  # a seeded sampling request runs alone
    assert b.next_batch(0.01) == [jobs[4]]
    assert b.next_batch(0.01) == []
    t0 = time.monotonic()
    b = Batcher(max_queue=5, max_rows=4, wait_s=0.2)
    first = b.submit(req())
    threading.Timer(0.05, lambda: b.submit(req())).start()
    assert len(b.next_batch(0.01)) == 2 and first is not None and time.monotonic() - t0 < 1.0


def test_queue_bound_disconnect_and_sigterm_drain(ckpt):
    """Requests wait 3 s for company: a client that hangs up frees its slot, a full queue answers
    503, SIGTERM answers what is queued, refuses what comes after, and exits 0."""
    proc, port = start(ckpt, 1, "--batch-wait-ms", "3000", "--max-queue", "2")
    try:
        body = json.dumps({"prompts": ["1 2"], "tokens_to_generate": 3, "top_k": 1}).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:  # sends, then hangs up
            s.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, put(port, {
            "prompts": [PROMPTS[i]], "tokens_to_generate": 3, "top_k": 1}))) for i in range(2)]
        [t.start() for t in threads]
        time.sleep(0.5)
        status, body = put(port, {"prompts": ["1"], "tokens_to_generate": 2, "top_k": 1})
        assert status == 503 and body["message"].startswith("server busy"), body
        os.kill(proc.rank0_pid, signal.SIGTERM)
        time.sleep(0.2)
        assert put(port, {"prompts": ["1"], "tokens_to_generate": 2, "top_k": 1}) == (
            503, {"message": "server is shutting down"})
        [t.join() for t in threads]
        assert [results[i][0] for i in range(2)] == [200, 200], results
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "after 2 requests in 1 batches" in out, out
