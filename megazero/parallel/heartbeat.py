"""A watchdog thread per rank: names the rank that went silent, and ends a rank that SIGTERM
finds blocked.

Collectives already honour ``--distributed-timeout-minutes`` (every group is created with it),
but the error they raise names a socket, not a rank, and a rank blocked inside a collective never
runs a Python signal handler. The watchdog adds both answers:

* **Heartbeats.** Every ``interval_s`` each rank adds 1 to its counter ``<prefix>/<rank>`` in the
  rendezvous store (``prefix``: the launch attempt's, given by
  :func:`megazero.parallel.launch.init_distributed`, so a restart never reads a killed attempt's counters) (its own client connection) and reads the counters of the ``watch`` ranks after
  it on the ring ``rank+1 .. rank+watch (mod world)``, so every rank is watched by ``watch``
  others at O(watch) store reads per rank and interval. A counter that has not moved for
  ``timeout_s - 2 interval_s`` (a rank stopped by SIGSTOP, a wedged GPU or NFS mount, a dead
  host; reported before the collectives' own timeout says only "timed out") makes the watcher
  print one line naming the silent rank and exit with status 1; the others follow through their
  own watchdog or through the closed connections. A rank that ends (normally or not) sets its
  counter negative first, so it is never reported as silent. A store that does not answer for
  ``timeout_s`` is reported the same way (it lives on rank 0 or the launcher's host).
* **SIGTERM / SIGINT while blocked.** The C-level signal handler writes the signal number to a
  wakeup socket (``signal.set_wakeup_fd``) even while the main thread is inside a collective; the
  watchdog then waits ``grace_s``. If the main thread has not moved off the frame it was in (it is
  blocked in C and its Python handler cannot run), the rank prints one line and exits with
  ``128 + signal``. A rank that is running Python handles the signal as before (save and exit at
  the iteration's end with ``--exit-signal-handler``).
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

ENDED = -(10 ** 12)  # added to a counter when its rank ends: negative means "gone on purpose"


class Heartbeat:
    """One rank's watchdog; :meth:`start` from the main thread after the process group exists."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 interval_s: float | None = None, watch: int = 8, grace_s: float = 10.0, prefix: str | None = None):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.5, min(10.0, timeout_s / 6))
        # silent this long = reported: two intervals before the collectives' own timeout would raise
        # (a watcher sees a beat up to one interval late), so the rank is named before they say "timed out"
        self.silent_s = max(2 * self.interval_s, timeout_s - 2 * self.interval_s)
        self.peers = [(rank + i) % world_size for i in range(1, min(watch, world_size - 1) + 1)]
        self.grace_s, self.prefix = grace_s, prefix or "megazero/heartbeat"
        self.stopped = threading.Event()
        self.store = None
        self.wake_r = self.wake_w = None
        self.thread = threading.Thread(target=self.run, name="megazero-heartbeat", daemon=True)

    def key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def start(self) -> "Heartbeat":
        """Connect, install the signal wakeup socket (main thread only) and start the thread."""
        self.store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(2.0, 2 * self.interval_s)))
        self.store.add(self.key(self.rank), 1)
        if threading.current_thread() is threading.main_thread():
            self.wake_r, self.wake_w = socket.socketpair()
            self.wake_r.setblocking(False)
            self.wake_w.setblocking(False)
            signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        atexit.register(self.stop)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Mark this rank as ended (never reported silent) and stop the thread."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        try:
            self.store.add(self.key(self.rank), ENDED)
        except Exception:  # noqa: BLE001 - the store may be gone already at exit
            pass

    def fail(self, message: str, code: int) -> None:
        """Print one line, mark this rank ended, leave now (the main thread may be blocked)."""
        print(f"rank {self.rank}: {message}", file=sys.stderr, flush=True)
        self.stop()
        os._exit(code)

    # ---- the thread --------------------------------------------------------------------
    def run(self) -> None:
        last_seen = {p: (None, time.monotonic()) for p in self.peers}  # peer -> (count, when it moved)
        store_ok = time.monotonic()
        signalled = None  # (signum, when, main frame state)
        while not self.stopped.is_set():
            signalled = self.check_signals(signalled)
            try:
                self.store.add(self.key(self.rank), 1)
                counts = self.read_counts()
                store_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - a store that stops answering is itself the fault
                if self.stopped.is_set():
                    return
                if time.monotonic() - store_ok > self.timeout_s:
                    self.fail(f"the rendezvous store at {self.host}:{self.port} (rank 0's or the launcher's host) "
                              f"has not answered for {self.timeout_s:.0f} s: exiting", 1)
                continue
            now = time.monotonic()
            for peer, count in counts.items():
                seen, moved = last_seen[peer]
                if count != seen:
                    last_seen[peer] = (count, now)
                elif count is None or count >= 0:
                    if now - moved > self.silent_s:
                        self.fail(f"rank {peer} has sent no heartbeat for {now - moved:.0f} s (collective timeout "
                                  f"{self.timeout_s:.0f} s, --distributed-timeout-minutes): it is stopped, "
                                  f"wedged or gone; exiting", 1)

    def read_counts(self) -> dict:
        keys = [self.key(p) for p in self.peers]
        present = [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        return {p: int(values[k]) if k in values else None for p, k in zip(self.peers, keys)}

    def check_signals(self, signalled):
        """Wait one interval on the wakeup socket; end the rank if a SIGTERM/SIGINT found the
        main thread blocked on one frame for ``grace_s``."""
        if self.wake_r is None:
            self.stopped.wait(self.interval_s)
            return None
        ready, _, _ = select.select([self.wake_r], [], [], self.interval_s)
        if ready:
            try:
                data = self.wake_r.recv(64)
            except BlockingIOError:
                data = b""
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT) and signalled is None:
                    signalled = (signum, time.monotonic(), main_frame_state())
        if signalled is not None and time.monotonic() - signalled[1] > self.grace_s:
            signum, _, state = signalled
            if main_frame_state() == state:
                self.fail(f"{signal.Signals(signum).name} received while blocked (in a collective or I/O) for "
                          f"{self.grace_s:.0f} s: exiting without saving", 128 + signum)
            signalled = None
        return signalled


def main_frame_state():
    """(frame id, last instruction) of the main thread: equal twice = it ran no Python between."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return None if frame is None else (id(frame), frame.f_lasti)
