"""Run a function on N forked ranks with a real gloo process group (tests and CPU benchmarks).

``run_distributed(fn, world_size, *args)`` forks ``world_size`` children.  Each child, before
any torch op, pins itself to one intra-op thread (forked children with a multi-threaded pool can
hang), joins a gloo process group through a ``TCPStore`` hosted by one more forked process, calls
``fn(rank, world_size, *args, **kwargs)`` and sends back its result (pickled) or its traceback.

The parent returns the list of results in rank order, or raises :class:`RankFailure` naming
every rank that failed with its traceback.  When one rank fails the others usually block in a
collective, so they get ``grace_s`` seconds to finish and are then killed; when nothing fails
but ``timeout_s`` passes, every rank is killed and :class:`RankTimeout` names the ranks that
were still running.  Nothing is left behind either way.

The parent starts no threads of its own (the store server runs in its own forked process, not in
the parent and not in rank 0): forking a process whose other threads may hold a lock (malloc, a
store's event loop) can deadlock the child, and a rank that hosted the store would have to
outlive every other rank, keeping its connections open after it fails.

Forking costs ~0.2 s for 8 ranks, so tests share start-up cost by checking several layouts
inside one launched function rather than by keeping a pool alive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

from megazero.parallel.heartbeat import Heartbeat


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeout(RuntimeError):
    """The ranks did not all finish within the timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_host(port, world_size, timeout_s):
    """A process that only hosts the rendezvous store, until the parent kills it."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=timeout_s))  # serves from its own thread while we sleep
    while True:
        time.sleep(3600)


def _child(rank, world_size, port, conn, fn, args, kwargs, collective_timeout_s, heartbeat_s):
    import torch
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=collective_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        heartbeat = Heartbeat("127.0.0.1", port, rank, world_size, heartbeat_s).start() if heartbeat_s else None
        result = fn(rank, world_size, *args, **kwargs)
        if heartbeat is not None:
            heartbeat.stop()
        payload = pickle.dumps(("ok", result))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        payload = pickle.dumps(("error", traceback.format_exc()))
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        os._exit(0)  # skip atexit handlers inherited from the parent (pytest, gloo teardown)


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0, grace_s: float = 5.0,
                    collective_timeout_s: float = 60.0, heartbeat_s: float | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    ``heartbeat_s``: start each rank's :class:`~megazero.parallel.heartbeat.Heartbeat` with that
    timeout, as a launched run does (fault tests).

    Returns the per-rank results; raises :class:`RankFailure` or :class:`RankTimeout`.
    """
    ctx = mp.get_context("fork")
    port = free_port()
    host = ctx.Process(target=_store_host, args=(port, world_size, collective_timeout_s), daemon=True)
    host.start()
    procs, conns = [], {}
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, daemon=True,
                        args=(rank, world_size, port, child_conn, fn, args, kwargs, collective_timeout_s, heartbeat_s))
        p.start()
        child_conn.close()
        procs.append(p)
        conns[parent_conn] = rank
    results, errors, order = {}, {}, []
    deadline = time.monotonic() + timeout_s
    first_error_at = None
    try:
        while conns:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + grace_s)
            if now >= limit:
                break
            for conn in wait(list(conns), timeout=limit - now):
                rank = conns.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    procs[rank].join(timeout=5)  # the pipe closes just before the exit status is known
                    status, value = "error", f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                (results if status == "ok" else errors)[rank] = value
                if status != "ok":
                    order.append(rank)
                if status != "ok" and first_error_at is None:
                    first_error_at = time.monotonic()
    finally:
        for p in procs + [host]:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    stuck = sorted(conns.values())
    if errors:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if stuck:
            parts.append(f"(ranks {stuck} were still running and were killed)")
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed (first: rank {order[0]}): ranks {sorted(errors)}\n"
                          + "\n".join(parts))
    if stuck:
        raise RankTimeout(f"ranks {stuck} of {world_size} did not finish within {timeout_s:.0f} s; all ranks killed")
    return [results[r] for r in range(world_size)]
