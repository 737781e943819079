"""``--async-save``'s writer: one long-lived process per rank that writes rank files from host
snapshot buffers in shared memory (the shape of Megatron-LM's ``PersistentAsyncCaller``,
``megatron/core/dist_checkpointing/strategies/async_utils.py``, commit 00caa53: a worker started
once per rank that takes save requests from a queue and reports each completion).

Protocol (trainer side :class:`AsyncWriter`, writer side :func:`serve`), over one Unix socket pair:

* **start** (the first save, or the first after the writer died): the writer is *spawned* as a
  fresh interpreter (``python -c``), so it shares no pages with the training process (a forked
  writer makes every page the training writes afterwards a copy-on-write fault); it lowers its
  priority to ``nice 19`` before importing torch, and ignores SIGINT / SIGTERM: it lives as long
  as its socket, and leaves at end-of-file when the training process exits or dies.
* **snapshot** (:meth:`AsyncWriter.submit`): the state is pickled in the training process with
  every tensor replaced by a reference (its storage's region, dtype, offset, size, stride); each
  distinct tensor storage gets a 64-byte aligned region of one shared buffer (a ``memfd``,
  allocated once and reused while the regions' sizes stay the same; reallocated, and its file
  descriptor passed with ``SCM_RIGHTS``, when they change, e.g. after a batch-size change). The
  save's only cost in the training process: that pickle (no tensor data) and one copy of each
  storage's bytes into its region. Then a small message names the file.
* **write** (:func:`serve`): the writer rebuilds the state with tensors viewing the regions (each
  region its own storage of the original's size, so ``torch.save`` writes the same records: the
  file is byte for byte what a synchronous save writes, CRC-32 included), writes ``FILE.partial``,
  renames it, and replies ``("ok", bytes)`` or ``("error", one line naming the file and cause)``.
* **wait** (:meth:`AsyncWriter.wait`): the reply; end-of-file instead means the writer died, and
  its exit status (``killed by signal 9``) is the error. A buffer is reused only after its write
  has been waited for.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys

import torch

_ALIGN = 64  # region alignment in the shared buffer (bytes)
_HEADER = struct.Struct("!Q")  # message length


def _send(sock: socket.socket, obj, fd: int | None = None) -> None:
    """One message: a tag byte (carrying ``fd`` as SCM_RIGHTS when given), length, pickle."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if fd is None:
        sock.sendall(b"P" + _HEADER.pack(len(payload)) + payload)
    else:
        socket.send_fds(sock, [b"F"], [fd])
        sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket):
    """``(message, fd or None)``, or None at end-of-file (the peer is gone)."""
    tag, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not tag:
        return None
    header = _recv_exact(sock, _HEADER.size)
    payload = _recv_exact(sock, _HEADER.unpack(header)[0]) if header is not None else None
    if payload is None:
        return None
    return pickle.loads(payload), (fds[0] if fds else None)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each region's offset (aligned to ``_ALIGN``) and the buffer's total size."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


class WriterDied(RuntimeError):
    """The writer process ended without answering; the message says how."""


class _Skeleton(pickle.Pickler):
    """Pickles a state with each tensor replaced by its index in ``tensors`` (one per object)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.index = [], {}

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self.index:
            self.index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return self.index[id(obj)]


class AsyncWriter:
    """The training process's side: a writer process and its shared snapshot buffer, one per
    rank, reused across saves (see the module docstring). Not thread-safe; one save in flight."""

    def __init__(self):
        self.proc, self.sock, self.buffer, self.sizes, self.in_flight = None, None, None, None, False
        self.allocations = 0  # shared buffers allocated so far (a reallocation when the state's shape changes)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "AsyncWriter":
        """Spawn the writer unless it runs (a fresh interpreter: no pages shared with this process).
        Called by the first :meth:`submit`; call it earlier to have torch imported by then."""
        if self.alive():
            return self
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        code = ("import os; os.nice(19)\n"  # low priority before anything, the import of torch included
                f"from megazero.checkpoint.async_writer import serve; serve({theirs.fileno()})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.sizes, self.buffer = ours, None, None  # a new writer maps a new buffer
        return self

    def _allocate(self, sizes: list[int]) -> None:
        """A shared buffer for regions of ``sizes`` bytes; its descriptor goes to the writer."""
        _, total = _layout(sizes)
        fd = os.memfd_create("megazero-checkpoint-snapshot")
        try:
            os.ftruncate(fd, total)
            mapped = mmap.mmap(fd, total)
            _send(self.sock, ("map", sizes), fd=fd)
        finally:
            os.close(fd)
        self.buffer, self.sizes = torch.frombuffer(mapped, dtype=torch.uint8), list(sizes)  # keeps `mapped`
        self.allocations += 1

    def _plan(self, state):
        """``(skeleton pickle, tensor specs, storages, their sizes)`` of ``state``: one region per
        distinct storage, as ``torch.save`` writes one record each."""
        out = io.BytesIO()
        pickler = _Skeleton(out)
        pickler.dump(state)
        regions, specs = {}, []
        for t in pickler.tensors:
            storage = t.untyped_storage()
            key = (storage.device, storage.data_ptr(), storage.nbytes()) if storage.nbytes() else ("empty", id(t))
            region = regions.setdefault(key, (len(regions), storage))[0]
            specs.append((region, str(t.dtype).removeprefix("torch."), t.storage_offset(), tuple(t.shape), t.stride()))
        storages = [s for _, s in sorted(regions.values(), key=lambda r: r[0])]
        return out.getvalue(), specs, storages, [s.nbytes() for s in storages]

    def reserve(self, state) -> None:
        """Start the writer and allocate the shared buffer a save of ``state`` (or of a state
        of the same shapes) will use, touching every page now: the first save then costs the
        training process one plain copy, like every later one, instead of also faulting the
        buffer in (measured 0.29 s against 0.06-0.08 s for 256 MiB). Nothing is written."""
        try:
            sizes = self.start()._plan(state)[3]
            if sizes != self.sizes:
                self._allocate(sizes)
                self.buffer.fill_(0)
        except (BrokenPipeError, ConnectionResetError):
            raise WriterDied(self._death()) from None

    def submit(self, path: str, state) -> None:
        """Snapshot ``state`` into the shared buffer and ask the writer to write it to ``path``
        (``path + '.partial'`` first, then renamed). Returns once the snapshot is taken; raises
        :class:`WriterDied` when the writer is found dead, or what the snapshot raised."""
        if self.in_flight:
            raise RuntimeError("AsyncWriter.submit: the previous save has not been waited for")
        self.start()
        payload, specs, storages, sizes = self._plan(state)
        try:
            if sizes != self.sizes:
                self._allocate(sizes)
            offsets, _ = _layout(sizes)
            for storage, offset, n in zip(storages, offsets, sizes):  # the one copy
                if n:
                    src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                    self.buffer[offset:offset + n].copy_(src)
            _send(self.sock, ("save", path, payload, specs))
        except (BrokenPipeError, ConnectionResetError):  # the socket's other end is closed: the writer is gone
            raise WriterDied(self._death()) from None
        self.in_flight = True

    def done(self) -> bool:
        """Whether the write in flight (if any) has answered or the writer is gone (no wait)."""
        return not self.in_flight or bool(select.select([self.sock], [], [], 0)[0])

    def wait(self) -> tuple[str | None, int]:
        """``(error or None, bytes written)`` of the write in flight; ``(None, 0)`` if none."""
        if not self.in_flight:
            return None, 0
        self.in_flight = False
        try:
            reply = _recv(self.sock)
        except OSError:
            reply = None
        if reply is None:
            return self._death(), 0
        (status, value), _ = reply
        return (None, value) if status == "ok" else (value, 0)

    def _death(self) -> str:
        """How the writer ended (it closed its socket without answering)."""
        code = self.proc.wait()
        self.close()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"the writer process (pid {self.proc.pid}) {how} before answering"

    def close(self) -> None:
        """Let the writer go: end-of-file on its socket (it finishes a write in progress, then
        exits; not waited for here -- its outcome is :meth:`wait`'s)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.proc.poll()  # reaped if it has already exited
        self.buffer, self.sizes, self.in_flight = None, None, False


def _write(mapped, sizes: list[int], path: str, payload: bytes, specs: list) -> tuple[str, object]:
    """The writer's work for one save (see the module docstring); returns its reply."""
    from megazero.checkpoint.guard import space_hint
    from megazero.config.failures import describe

    partial = path + ".partial"
    try:
        offsets, _ = _layout(sizes)
        storages = [torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=o).untyped_storage() if n
                    else torch.empty(0, dtype=torch.uint8).untyped_storage() for o, n in zip(offsets, sizes)]
        tensors = {}

        def load(index):
            if index not in tensors:
                region, dtype, offset, shape, stride = specs[index]
                tensors[index] = torch.empty(0, dtype=getattr(torch, dtype)).set_(storages[region], offset,
                                                                                  shape, stride)
            return tensors[index]

        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = load
        state = unpickler.load()
        with open(partial, "wb") as fh:  # as the synchronous save: through a Python file, same records
            torch.save(state, fh)
        os.replace(partial, path)
        return "ok", os.path.getsize(path)
    except BaseException as e:  # the trainer raises it on every rank: the file and the cause
        return "error", f"{describe(e, default_file=partial)}{space_hint(os.path.dirname(path))}"


def serve(fd: int) -> None:
    """The writer process's loop (started at ``nice 19``): map buffers, write files, answer;
    return at end-of-file."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a stopped job stops the trainer; it ends us by EOF
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    mapped, sizes = None, None
    while True:
        try:
            message = _recv(sock)
        except ConnectionResetError:  # the training rank is gone: as end-of-file
            return
        if message is None:
            return
        (kind, *body), passed = message
        if kind == "map":
            sizes = body[0]
            mapped = mmap.mmap(passed, _layout(sizes)[1])
            os.close(passed)
        elif kind == "save":
            reply = _write(mapped, sizes, *body)
            try:
                _send(sock, reply)
            except (BrokenPipeError, ConnectionResetError):  # the rank died while this file was written
                print(f"megazero async checkpoint writer: its training rank exited while {body[0]} was being "
                      "written; that checkpoint is not published (its folder stays *.tmp), the previously "
                      "published checkpoint is intact", file=sys.stderr, flush=True)
                return
