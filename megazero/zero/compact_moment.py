"""A second moment stored only where AdamW steps (Muon's matrices have none).

:class:`CompactMoment` stands in for a region's shard-length ``exp_avg_sq`` after
``ZeroOptimizer.set_muon``: it stores the elements of the ``keep`` ranges (the shard's AdamW
ranges: whole AdamW parameters and the padding, never part of a Muon matrix) in one flat fp32
tensor and reads as zero elsewhere. What the region and the checkpoints do with the shard still
works: a slice inside a kept range is a view of the storage, a slice outside every kept range a
fresh zero tensor (writes to it are dropped: Muon's second moment is zero), ``clone()`` the whole
shard-length vector (a checkpoint's shard), ``copy_(full)`` takes the kept ranges of one.
Memory: 4 bytes per AdamW element instead of per shard element.
"""

from __future__ import annotations

import torch


class CompactMoment:
    """Shard-length fp32 vector, zero outside ``keep`` (sorted, disjoint ``[a, b)`` ranges)."""

    def __init__(self, shard_len: int, keep, device, source: torch.Tensor | None = None):
        self.shard_len, self.keep = shard_len, [(a, b) for a, b in keep if a < b]
        self.starts, n = [], 0
        for a, b in self.keep:
            self.starts.append(n)
            n += b - a
        self.data = torch.zeros(n, dtype=torch.float32, device=device)
        if source is not None:
            self.copy_(source)

    def numel(self) -> int:
        """Elements actually stored."""
        return self.data.numel()

    def __getitem__(self, sl: slice) -> torch.Tensor:
        a = 0 if sl.start is None else sl.start
        b = self.shard_len if sl.stop is None else sl.stop
        for (c, d), s in zip(self.keep, self.starts):
            if c <= a and b <= d:
                return self.data[s + a - c:s + b - c]
            if a < d and c < b:
                raise ValueError(f"slice [{a}, {b}) crosses the kept range [{c}, {d})")
        return torch.zeros(max(b - a, 0), dtype=torch.float32, device=self.data.device)

    def clone(self) -> torch.Tensor:
        """The whole shard-length vector (zeros outside the kept ranges)."""
        out = torch.zeros(self.shard_len, dtype=torch.float32, device=self.data.device)
        for (c, d), s in zip(self.keep, self.starts):
            out[c:d].copy_(self.data[s:s + d - c])
        return out

    def copy_(self, full: torch.Tensor) -> "CompactMoment":
        """Take the kept ranges of a shard-length vector."""
        for (c, d), s in zip(self.keep, self.starts):
            self.data[s:s + d - c].copy_(full[c:d])
        return self
