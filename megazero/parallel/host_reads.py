"""Device-to-host reads, counted.

A read of a device tensor on the host (``.item()``, ``.tolist()``, ``float(t)``) waits for every
kernel queued before it; on a GPU each one stalls the CPU that should be queueing the next
iteration's work. The training loop and the ZeRO optimizer make every such read through one
:class:`HostReads` object, so the number per iteration is a fact a test can check
(tests/test_host_syncs.py: one per iteration, the read of the packed per-iteration scalars).
"""

from __future__ import annotations

import torch


class HostReads:
    """Reads device tensors to the host and counts the reads (``count``)."""

    def __init__(self):
        self.count = 0

    def read(self, t: torch.Tensor) -> list:
        """``t`` as a flat Python list (one synchronizing copy, counted)."""
        self.count += 1
        return t.detach().reshape(-1).tolist()
