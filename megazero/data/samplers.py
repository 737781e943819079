"""Batch samplers and collation for pretraining.

:class:`PretrainingSampler` follows Megatron-LM's ``MegatronPretrainingSampler``: global sample
positions ``consumed_samples, consumed_samples + 1, ...`` are cut into chunks of
``micro_batch_size * data_parallel_size``; data-parallel rank r takes positions
``[r * mbs, (r + 1) * mbs)`` of each chunk. One global batch is ``num_micro_batches`` such
chunks, so after ``k`` iterations ``consumed_samples = k * global_batch_size`` and a resumed run
that passes that number continues on exactly the next sample. With ``drop_last`` (default) a
final partial chunk is dropped; otherwise each rank gets its part of it (possibly empty, then
nothing is yielded).

:func:`micro_batch_indices` is the endless form the training loop reads (the same chunks, wrapping
to sample 0 for evaluation); :class:`ReadAhead` runs a read function over it on one background
thread, a bounded number of items ahead of the consumer, in order.

torch is imported lazily so that importing :mod:`megazero.data` stays cheap.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Iterator

import numpy as np

__all__ = ["PretrainingSampler", "collate", "build_pretraining_data_loader",
           "get_tokens_and_labels", "micro_batch_indices", "ReadAhead"]


class PretrainingSampler:
    """Yields lists of dataset indices, one micro-batch of this DP rank per step."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} outside "
                             f"[0, total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} outside "
                             f"[0, {data_parallel_size})")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last

    @property
    def chunk(self) -> int:
        """Samples consumed by all DP ranks per micro-batch step."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.chunk
        if self.drop_last:
            return full
        tail = remaining - full * self.chunk
        return full + int(tail > self.data_parallel_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        mbs, rank = self.micro_batch_size, self.data_parallel_rank
        start = self.consumed_samples
        while start + self.chunk <= self.total_samples:
            first = start + rank * mbs
            yield list(range(first, first + mbs))
            start += self.chunk
        if not self.drop_last and start < self.total_samples:
            first = start + rank * mbs
            last = min(first + mbs, self.total_samples)
            if first < last:
                yield list(range(first, last))


def collate(samples: list[dict]) -> dict:
    """[{"text": int64 array (s+1,)}, ...] -> {"text": torch.LongTensor [b, s+1]}."""
    import torch

    return {"text": torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64)
                                               for s in samples]))}


def get_tokens_and_labels(batch: dict):
    """{"text": [b, s+1]} -> (tokens [b, s], labels [b, s]): inputs and next-token targets."""
    text = batch["text"]
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 0):
    """A torch DataLoader over ``dataset`` driven by :class:`PretrainingSampler`.

    Returns None when ``dataset`` is None (an empty split).
    """
    if dataset is None:
        return None
    import torch

    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                       num_workers=num_workers, pin_memory=False,
                                       persistent_workers=num_workers > 0)


def micro_batch_indices(total_samples: int, consumed_samples: int, micro_batch_size: int,
                        data_parallel_rank: int, data_parallel_size: int,
                        cycle: bool = False) -> Iterator[list[int]]:
    """This DP rank's micro-batch index lists from ``consumed_samples`` on: the
    :class:`PretrainingSampler` chunks of ``micro_batch_size * data_parallel_size`` samples.
    At the end of the samples: with ``cycle`` start again at sample 0 (evaluation), else raise
    ``RuntimeError("ran out of training samples (N)")`` when the next micro-batch is asked for.
    The sequence depends only on ``consumed_samples`` (not on how many micro-batches make an
    iteration), so resuming at ``k`` consumed samples continues exactly."""
    start = consumed_samples
    while True:
        yield from PretrainingSampler(total_samples, start, micro_batch_size, data_parallel_rank,
                                      data_parallel_size)
        if not cycle:
            raise RuntimeError(f"ran out of training samples ({total_samples})")
        start = 0


class _Shared:
    """What the reader thread and the consumer share, guarded by ``cond``: the results read so far
    and not taken (``(ok, value)`` pairs, in order), the read-ahead bound, the stop flag."""

    def __init__(self, ahead: int):
        self.cond = threading.Condition()
        self.ready: collections.deque = collections.deque()
        self.ahead, self.stop = max(int(ahead), 1), False

    def halt(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


def _read_loop(shared: _Shared, work: Iterator, read: Callable) -> None:
    """The reader thread: ``read(next(work))`` while fewer than ``shared.ahead`` results wait;
    the first exception is queued as a result and ends the thread. Holds no reference to the
    :class:`ReadAhead`, so dropping that stops the thread (its finalizer sets ``stop``)."""
    while True:
        with shared.cond:
            while not shared.stop and len(shared.ready) >= shared.ahead:
                shared.cond.wait()
            if shared.stop:
                return
        try:
            entry = (True, read(next(work)))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            entry = (False, e)
        with shared.cond:
            shared.ready.append(entry)
            shared.cond.notify_all()
        if not entry[0]:
            return


class ReadAhead:
    """``read(item)`` for each item of ``work``, in order, on one daemon thread that keeps at most
    ``ahead`` results waiting (read ahead while the caller computes); ``threaded=False`` reads on
    the calling thread inside :meth:`take` (nothing ahead).

    An exception raised by ``work`` or ``read`` is raised again, the same object with its own
    message, by the :meth:`take` that reaches its position (results before it are delivered
    first), and by every later one. :meth:`close` (or dropping the object, or leaving a ``with``
    block) sets the stop flag and joins the thread; being a daemon, it never holds up exit."""

    def __init__(self, work: Iterator, read: Callable, ahead: int = 1, threaded: bool = True,
                 name: str = "megazero-read-ahead"):
        self._work, self._read = work, read
        self._shared = _Shared(ahead)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=_read_loop, args=(self._shared, work, read), name=name,
                                            daemon=True)
            self._thread.start()
        self._finalizer = weakref.finalize(self, self._shared.halt)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def take(self, n: int, ahead: int | None = None) -> list:
        """The next ``n`` results, in order. ``ahead``: how many results to read ahead from now on
        (e.g. the next iteration's count), kept as it was if None."""
        shared = self._shared
        if shared.stop:
            raise RuntimeError("ReadAhead.take after close()")
        if self._thread is None:
            return [self._take_here() for _ in range(n)]
        out = []
        with shared.cond:
            if ahead is not None:
                shared.ahead = max(int(ahead), 1)
            while len(out) < n:
                while not shared.ready:
                    shared.cond.wait()
                ok, value = shared.ready[0]
                if not ok:
                    raise value
                shared.ready.popleft()
                shared.cond.notify_all()
                out.append(value)
        return out

    def _take_here(self):
        """One result read on the calling thread (``threaded=False``); a failure is kept and
        raised again by every later call, as from the thread."""
        if self._shared.ready:
            raise self._shared.ready[0][1]
        try:
            return self._read(next(self._work))
        except BaseException as e:
            self._shared.ready.append((False, e))
            raise

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and wait for it (it finishes the read in progress, if any)."""
        self._finalizer()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
