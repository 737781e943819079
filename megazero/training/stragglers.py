"""Straggler detection (``--log-straggler``): the slowest and fastest ranks, named with their hosts.

Megatron-LM's ``StragglerDetector`` (core_v0.19.0, commit 5be9626, megatron/core/utils.py;
megatron/core/README_STRAGGLER.md): ``pretrain_gpt.py`` times each forward call of the model
(``with stimer:``; CUDA events and ``perf_counter``, the larger of the two) and each batch read
(``with stimer(bdata=True):``); every ``--log-interval`` iterations ``training.py`` calls
``report``, which gathers every rank's mean forward time per iteration (``Rtt``), longest batch
read (``DRtt``) and estimated throughput (``Etpt`` = the iteration's model FLOPs / (Rtt x 1e9 x
world) / 3, only the forward being timed) on rank 0 and logs the minimum and maximum of each with
its rank, plus, with ``--straggler-minmax-count N`` (1 < N < world), the N lowest and highest
Etpt. ``--straggler-ctrlr-port``: rank 0 listens there, and any connection (``curl HOST:PORT``)
toggles detection at the next report (broadcast from rank 0); ``--disable-straggler-on-startup``
starts it off.

megazero: the same timings (:meth:`StragglerDetector.timed` wraps the forward step, :meth:`data`
the batch read); each rank writes its two numbers into its own slots of a ``2 x world`` vector
and the toggle into one more, which ride in the iteration's packed all-reduce (:mod:`.agree`) on
log iterations (they pack anyway): the sum is the gather, nothing else is synchronized. Host
names are gathered once at start-up. On CUDA an iteration's events are read after its host read
(then they are complete), so a report covers the iterations since the previous one up to the one
before it. GPU power, temperature, utilization and clock (Megatron reads them through NVML) are
left out of the line.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime

import torch
import torch.distributed as dist

AMP = 3.0  # Megatron's ``amp``: only the forward is timed


@dataclass(frozen=True)
class StragglerReport:
    """One report: per rank its mean forward ms per iteration, longest batch read (ms), Etpt (TF)."""

    rtt: tuple[float, ...]
    drtt: tuple[float, ...]
    etpt: tuple[float, ...]
    hosts: tuple[str, ...]

    @property
    def slowest(self) -> int:
        return max(range(len(self.rtt)), key=lambda r: self.rtt[r])

    @property
    def fastest(self) -> int:
        return min(range(len(self.rtt)), key=lambda r: self.rtt[r])

    def lines(self, minmax_count: int) -> list[str]:
        """Megatron's report line (the measured fields), its Bottom/Top lines, and the hosts."""
        def mm(values, unit):
            lo, hi = min(range(len(values)), key=values.__getitem__), max(range(len(values)), key=values.__getitem__)
            return f"{values[lo]:.2f}{unit}/{lo}", f"{values[hi]:.2f}{unit}/{hi}"
        (rlo, rhi), (dlo, dhi), (elo, ehi) = mm(self.rtt, "ms"), mm(self.drtt, "ms"), mm(self.etpt, "TF")
        now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        out = [f"[{now}] | MnRtt/Rnk: {rlo} | MxRtt/Rnk: {rhi} | MnDRtt/Rnk: {dlo} | MxDRtt/Rnk: {dhi} | "
               f"MnEtpt/Rnk: {elo} | MxEtpt/Rnk: {ehi}"]
        world = len(self.rtt)
        if 1 < minmax_count < world:
            order = sorted(range(world), key=lambda r: self.etpt[r])
            pairs = [f" {self.etpt[r]:.2f}/{r}," for r in order]
            out.append(f"^^^^ Bottom {minmax_count} Ranks with lowest  Etpt(TF):" + "".join(pairs[:minmax_count]))
            out.append(f"^^^^ Top    {minmax_count} Ranks with highest Etpt(TF):" + "".join(pairs[-minmax_count:]))
        s, f = self.slowest, self.fastest
        out.append(f"stragglers: slowest rank {s} on {self.hosts[s]} ({self.rtt[s]:.2f} ms forward per iteration), "
                   f"fastest rank {f} on {self.hosts[f]} ({self.rtt[f]:.2f} ms)")
        return out

    def scalars(self) -> dict:
        """TensorBoard scalars (megazero's names; Megatron writes none)."""
        s, f = self.slowest, self.fastest
        return {"straggler-max-rtt-ms": self.rtt[s], "straggler-max-rtt-rank": s,
                "straggler-min-rtt-ms": self.rtt[f], "straggler-min-rtt-rank": f,
                "straggler-min-etpt-tflops": min(self.etpt), "straggler-max-etpt-tflops": max(self.etpt)}


class StragglerDetector:
    """One rank's timings and its share of the reports (see the module docstring)."""

    def __init__(self, cfg, rank: int, world: int, device):
        self.on, self.minmax_count, self.rank, self.world = cfg.straggler_on_startup, cfg.straggler_minmax_count, rank, world
        self.cuda = device.type == "cuda"
        self.hosts = [None] * world
        if dist.is_initialized() and world > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())
        else:
            self.hosts = [socket.gethostname()]
        self.fwd_ms = self.data_ms = 0.0
        self.iterations = 0
        self.calls: list = []  # this iteration's (perf ms, CUDA start, CUDA stop)
        self.toggle = False
        if rank == 0:
            self._listen(cfg.straggler_port)

    def timed(self, forward_step):
        """``forward_step`` timed while detection is on."""
        def run(chunk, micro_batch, input_tensor):
            if not self.on:
                return forward_step(chunk, micro_batch, input_tensor)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
            if events:
                events[0].record()
            t0 = time.perf_counter()
            out = forward_step(chunk, micro_batch, input_tensor)
            ms = (time.perf_counter() - t0) * 1000.0
            if events:
                events[1].record()
            self.calls.append((ms, events))
            return out
        return run

    @contextlib.contextmanager
    def data(self):
        """Times a batch read (the longest of the interval is reported)."""
        t0 = time.perf_counter()
        yield
        if self.on:
            self.data_ms = max(self.data_ms, (time.perf_counter() - t0) * 1000.0)

    def end_iteration(self) -> None:
        """After the iteration's host read (and its report, if due): its forward calls' time (their
        CUDA events are done) joins the interval the next report covers."""
        if self.on and self.calls:
            self.fwd_ms += sum(max(ms, ev[0].elapsed_time(ev[1]) if ev else 0.0) for ms, ev in self.calls)
            self.iterations += 1
        self.calls = []

    def slots(self, device) -> torch.Tensor:
        """For a log iteration's packed sum: the toggle (rank 0) and, while on, this rank's two
        numbers in its slots (device fills of host numbers: no copy, no sync)."""
        vec = torch.zeros(1 + (2 * self.world if self.on else 0), dtype=torch.float32, device=device)
        if self.toggle:
            vec[0].fill_(1.0)
        if self.on and self.iterations:
            vec[1 + 2 * self.rank].fill_(self.fwd_ms / self.iterations)
            vec[2 + 2 * self.rank].fill_(self.data_ms)
        return vec

    def size(self) -> int:
        return 1 + (2 * self.world if self.on else 0)

    def read(self, summed, flops_per_iteration: float) -> StragglerReport | None:
        """The report from the world sums of :meth:`slots` (None: off, or nothing timed yet), then
        the agreed toggle; the interval's timings restart."""
        report = None
        if self.on and len(summed) > 1 and any(summed[1::2]):
            rtt, drtt = tuple(summed[1::2]), tuple(summed[2::2])
            etpt = tuple(flops_per_iteration / (t * 1e9 * self.world) / AMP if t > 0 else 0.0 for t in rtt)
            report = StragglerReport(rtt, drtt, etpt, tuple(self.hosts))
            if self.rank == 0:
                print("\n".join(report.lines(self.minmax_count)), flush=True)
        if summed[0] > 0:
            self.on, self.toggle = not self.on, False
            if self.rank == 0:
                print(f"Toggling StragglerDetector State {'ON' if self.on else 'OFF'}", flush=True)
        self.fwd_ms = self.data_ms = 0.0
        self.iterations = 0
        return report

    def _listen(self, port: int) -> None:
        """Rank 0's controller: any connection to ``port`` asks for a toggle (Megatron's reply)."""
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", port))
            sock.listen(128)
        except OSError as e:
            print(f"StragglerDetector cannot be controlled.. {e} (--straggler-ctrlr-port {port})", flush=True)
            return
        print(f"Controller ready to recv commands on port {port}. Current state {'ON' if self.on else 'OFF'}",
              flush=True)

        def serve():
            while True:
                try:
                    conn, _ = sock.accept()
                    conn.recv(1024)
                    self.toggle = True
                    msg = f"Will turn StragglerDetector {'OFF' if self.on else 'ON'} at next logging interval"
                    conn.send(f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}\r\n\r\n{msg}".encode())
                    conn.close()
                    print(msg, flush=True)
                except OSError:
                    return
        threading.Thread(target=serve, name="straggler", daemon=True).start()
