"""Batch samplers and collation for pretraining.

:class:`PretrainingSampler` follows Megatron-LM's ``MegatronPretrainingSampler``: global sample
positions ``consumed_samples, consumed_samples + 1, ...`` are cut into chunks of
``micro_batch_size * data_parallel_size``; data-parallel rank r takes positions
``[r * mbs, (r + 1) * mbs)`` of each chunk. One global batch is ``num_micro_batches`` such
chunks, so after ``k`` iterations ``consumed_samples = k * global_batch_size`` and a resumed run
that passes that number continues on exactly the next sample. With ``drop_last`` (default) a
final partial chunk is dropped; otherwise each rank gets its part of it (possibly empty, then
nothing is yielded).

torch is imported lazily so that importing :mod:`megazero.data` stays cheap.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["PretrainingSampler", "collate", "build_pretraining_data_loader",
           "get_tokens_and_labels"]


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
