#!/usr/bin/env python
"""The REST server under load: tokens/s and latency at 1, 4, 16 concurrent clients vs the same
prompts generated one by one in-process (tools/generate.py, batch 1, no HTTP).

A demo-sized GPT (4 layers, hidden 128, 4 heads, vocabulary 4096, 128 positions, NullTokenizer) is
trained one iteration and saved; ``tools/run_text_generation_server.py`` serves it (TP ``--tp``,
one thread per rank). ``--requests`` single-prompt greedy requests (``top_k 1``,
``--prompt-len`` random ids, ``tokens_to_generate --new``) are sent by C client threads for each
C; tokens/s = generated tokens / wall time, latency per request (p50 / p95). The greedy texts over
HTTP are checked equal to tools/generate.py's. Bounded: every request times out after 120 s and
the whole run stops after ``--max-seconds``.

    PYTHONPATH=. .venv/bin/python bench/serve.py [--tp 1] [--requests 32] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from megazero.testing import free_port, run_distributed  # noqa: E402


def _train(rank, world, argv):
    import signal as sig

    from megazero.arguments import parse_args
    from megazero.training import setup
    from megazero.training.signals import ExitSignal
    trainer = setup(parse_args(argv, world_size=world))
    trainer.train(ExitSignal.install((sig.SIGUSR1,)))
    trainer.tb.close()


def checkpoint(folder: str) -> str:
    save = os.path.join(folder, "ckpt")
    run_distributed(_train, 1, ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                                "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
                                "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0", "--mock-data",
                                "--vocab-size", "4096", "--tokenizer-type", "NullTokenizer", "--save", save,
                                "--distributed-backend", "gloo", "--init-method-std", "0.2"], timeout_s=300)
    return save


def put(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def start_server(ckpt: str, tp: int, extra: list[str]):
    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "tools/run_text_generation_server.py"), "--load", ckpt,
           "--port", str(port), "--tensor-model-parallel-size", str(tp), "--num-threads", "1", *extra]
    if tp > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port", str(free_port())]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return proc, port, json.loads(r.read())["pid"]
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("the server failed to start")
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start in 120 s")


def load(port: int, prompts: list[str], new: int, clients: int, deadline: float) -> dict:
    """Send every prompt once from ``clients`` threads; tokens/s and latencies."""
    todo, lock, lat, tokens = list(enumerate(prompts)), threading.Lock(), [], [0]
    texts = [None] * len(prompts)

    def client():
        while time.monotonic() < deadline:
            with lock:
                if not todo:
                    return
                i, prompt = todo.pop(0)
            t0 = time.perf_counter()
            body = put(port, {"prompts": [prompt], "tokens_to_generate": new, "top_k": 1})
            with lock:
                lat.append(time.perf_counter() - t0)
                tokens[0] += len(body["tokens"][0]) - len(prompt.split())
                texts[i] = body["text"][0]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    lat.sort()
    return dict(tok_s=tokens[0] / wall, p50=statistics.median(lat), p95=lat[int(0.95 * (len(lat) - 1))],
                wall=wall, texts=texts, done=len(lat))


def one_by_one(ckpt: str, prompts: list[str], new: int) -> tuple[list[str], float]:
    """tools/generate.py's greedy completions (batch 1), and its tokens/s over the generate calls."""
    import contextlib
    import io

    import generate as gen_tool
    argv = ["--load", ckpt, "--max-new-tokens", str(new), "--batch-size", "1", "--num-threads", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ref = gen_tool.main(argv + [a for q in prompts for a in ("--prompt", q)])
    line = [x for x in out.getvalue().splitlines() if x.startswith("> generated")][-1]
    return ref, float(line.split(": ")[1].split(" tokens/s")[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-seconds", type=float, default=300)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.max_seconds
    rng = random.Random(0)
    prompts = [" ".join(str(rng.randrange(4095)) for _ in range(args.prompt_len)) for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(tmp)
        ref, base_tok = one_by_one(ckpt, prompts, args.new)
        proc, port, pid = start_server(ckpt, args.tp, ["--max-queue", str(max(64, args.requests))])
        rows = []
        try:
            for c in args.clients:
                r = load(port, prompts, args.new, c, deadline)
                same = r["texts"] == [q + c_ for q, c_ in zip(prompts, ref)]
                rows.append((c, r, same))
        finally:
            os.kill(pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"\nserver TP {args.tp}, {args.requests} requests x {args.new} new tokens, prompt {args.prompt_len}")
    print("| clients | tokens/s | vs one by one | p50 latency s | p95 latency s | greedy = generate.py |")
    print("|---|---|---|---|---|---|")
    print(f"| one by one, in-process (generate.py, batch 1) | {base_tok:.0f} | 1.00x | - | - | - |")
    for c, r, same in rows:
        print(f"| {c} | {r['tok_s']:.0f} | {r['tok_s'] / base_tok:.2f}x | {r['p50']:.3f} | {r['p95']:.3f} | "
              f"{'yes' if same else 'NO'} ({r['done']}/{args.requests} done) |")


if __name__ == "__main__":
    main()
