#!/usr/bin/env python
"""Serve a megazero checkpoint over Megatron-LM's text-generation REST API, tensor-parallel.

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load runs/demo/checkpoints \\
        --tensor-model-parallel-size 2 --port 5000
    python tools/run_text_generation_server.py --load DIR --port 5000 --host 0.0.0.0
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["In the beginning"], "tokens_to_generate": 20, "top_k": 1}'

Rank 0 serves HTTP (``PUT /api``: Megatron's request and response fields; ``GET /health``); every
rank loads the model as ``tools/generate.py`` does (same code) and runs each batch: rank 0
broadcasts it, all ranks call :func:`megazero.inference.generation.generate`. Concurrent requests
are batched (``--max-batch-size`` prompts, ``--batch-wait-ms``; see
:mod:`megazero.inference.serving`); more than ``--max-queue`` waiting requests get 503. A bad request
gets 400 ``{"message": ...}`` with Megatron's wording. SIGTERM stops accepting (503), finishes
the queued requests, and exits. Binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import generate as gen_tool  # noqa: E402  (tools/generate.py: one loading and decoding path)
from megazero.inference.serving import Batcher, RequestError, batch_work, cut_row, parse_request, run_work  # noqa: E402

MAX_BODY = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="run_text_generation_server.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    gen_tool.add_model_args(p)
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--max-batch-size", type=int, default=16, help="prompts per generate() batch")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="how long a request waits for company")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503")
    args = p.parse_args(argv)
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--max-queue", args.max_queue),
                        ("--tensor-model-parallel-size", args.tensor_model_parallel_size)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.batch_wait_ms < 0:
        p.error(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms}")
    return args


class Server:
    """Rank 0's side: the HTTP threads queue requests; :meth:`loop` batches them for every rank."""

    def __init__(self, args, model, tok):
        self.args, self.model, self.tok, self.eod = args, model, tok, getattr(tok, "eod", None)
        self.batcher = Batcher(args.max_queue, args.max_batch_size, args.batch_wait_ms / 1000)
        self.stopping = threading.Event()
        self.httpd = None
        self.stats = {"requests": 0, "batches": 0}

    def handle(self, body: bytes) -> tuple[int, dict]:
        """(status, JSON body) of one ``PUT /api``; blocks until its batch has run."""
        if self.stopping.is_set():
            return 503, {"message": "server is shutting down"}
        try:
            request = parse_request(json.loads(body), self.tok.tokenize, self.eod,
                                    self.model.config.max_position_embeddings)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return 400, {"message": f"Failed to decode JSON object: {e}"}
        except RequestError as e:
            return 400, {"message": str(e)}
        job = self.batcher.submit(request)
        if job is None:
            return 503, {"message": f"server busy: {self.args.max_queue} requests queued (--max-queue); retry later"}
        return job

    def finish(self, jobs, rows, lps, error: str | None = None) -> None:
        """Build each job's Megatron response (text, segments, tokens, logprobs) and wake its thread."""
        i = 0
        for job in jobs:
            r, out = job.request, {"text": [], "segments": [], "tokens": []}
            for prompt, ids in zip(r.prompts, r.ids):
                if error is None:
                    row = cut_row(rows[i], r, self.tok.detokenize)
                    full, completion = gen_tool.completion_text(self.tok, ids, row, self.eod)
                    seq = ids + row
                    out["text"].append(prompt + completion)
                    out["segments"].append([self.tok.detokenize([t]) for t in seq])
                    out["tokens"].append(seq)
                    if r.logprobs:
                        out.setdefault("logprobs", []).append(lps[i][:len(seq) - 1])
                i += 1
            job.response, job.error = out, error
            job.done.set()

    def loop(self, follow) -> None:
        """Rank 0: hand out batches until SIGTERM and an empty queue; ``follow(work, stop_rows)`` runs
        one batch on every rank (broadcast + generate) and returns (rows, logprobs); ``stop_rows``
        flags the rows whose client disconnected (they stop at the next token)."""
        while not (self.stopping.is_set() and len(self.batcher) == 0):
            jobs = self.batcher.next_batch(idle_s=0.5)
            if not jobs:
                follow({"op": "idle"})
                continue
            try:  # a client that leaves mid-generation ends its rows at the next token
                rows, lps = follow(batch_work(jobs), lambda: [j.cancelled for j in jobs for _ in j.request.ids])
            except (ValueError, RuntimeError) as e:
                self.finish(jobs, None, None, f"generation failed: {e}")
                continue
            self.finish(jobs, rows, lps)
            self.stats["batches"] += 1
            self.stats["requests"] += len(jobs)
        follow({"op": "stop"})
        self.batcher.close("server is shutting down")  # a request that slipped in after the last batch


def make_handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet: one line per error only
            if os.environ.get("MEGAZERO_SERVER_LOG"):
                super().log_message(fmt, *a)

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") != "/health":
                return self.reply(404, {"message": f"no such endpoint {self.path}: PUT /api, GET /health"})
            self.reply(503 if server.stopping.is_set() else 200,
                       {"status": "draining" if server.stopping.is_set() else "ok", "queued": len(server.batcher),
                        "tensor_model_parallel_size": server.args.tensor_model_parallel_size,
                        "max_position_embeddings": server.model.config.max_position_embeddings,
                        "pid": os.getpid(), **server.stats})  # rank 0's: SIGTERM it to drain (under torchrun too)

        def do_PUT(self):
            if self.path.rstrip("/") != "/api":
                return self.reply(404, {"message": f"no such endpoint {self.path}: PUT /api, GET /health"})
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                self.close_connection = True
                return self.reply(413, {"message": f"request body over {MAX_BODY} bytes"})
            got = server.handle(self.rfile.read(n))
            if isinstance(got, tuple):
                return self.reply(*got)
            while not got.done.wait(0.05):
                if _disconnected(self.connection):  # frees its queue slot if not yet running
                    got.cancelled = True
                    return
            if got.error is not None:
                return self.reply(503 if server.stopping.is_set() else 500, {"message": got.error})
            self.reply(200, got.response)

        do_POST = do_PUT  # Megatron's clients PUT; POST is accepted as well

    return Handler


def _disconnected(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def serve(args) -> None:
    topo, model, tok, agree = gen_tool.load_for_generation(args)
    rank0 = topo is None or topo.rank == 0
    eod = getattr(tok, "eod", None)
    device = model.device

    def follow(work, stop_rows=None):
        if topo is not None:
            box = [work]
            dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
            work = box[0]
        if work["op"] != "generate":
            return work["op"]
        return run_work(model, work, eod, agree, stop_rows if rank0 else None)

    if not rank0:  # followers: SIGTERM is rank 0's to act on; they stop when it says so
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            try:
                if follow(None) == "stop":
                    return
            except (ValueError, RuntimeError):
                continue  # rank 0 met the same error and answers the request with it
    server = Server(args, model, tok)
    server.httpd = ThreadingHTTPServer((args.host, args.port), make_handler(server))
    server.httpd.daemon_threads = False  # server_close() waits for the in-flight responses
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stopping.set())
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    print(f"> serving on http://{args.host}:{server.httpd.server_port}/api (TP {args.tensor_model_parallel_size}, "
          f"batch <= {args.max_batch_size}, wait {args.batch_wait_ms} ms, queue <= {args.max_queue})", flush=True)
    try:
        server.loop(follow)
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        print(f"> server stopped after {server.stats['requests']} requests in {server.stats['batches']} batches",
              flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        serve(args)
    except (gen_tool.CheckpointError, OSError, ValueError, KeyError) as e:
        if gen_tool.debug_requested(args.debug):
            raise
        raise SystemExit(f"run_text_generation_server.py: error: {e}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
