"""Host (CPU) memory: give ZeRO's freed transient buffers back to the operating system.

ZeRO allocates and frees large host buffers every micro-batch when its tensors live on the CPU
(a stage-3 unit's gathered parameters, L p bytes; a region's fp32 gradient of one round, L g
bytes; gloo's gather temporaries), and the CPU allocator is the C library's ``malloc``.
glibc's ``malloc`` serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``
and unmaps it on ``free``, but by default that threshold is *dynamic*: freeing an mmapped block
raises it to the block's size (up to 32 MiB), so from then on the units' buffers come from the
heap, whose freed middle is kept (and counted in the resident set) until the top is free. A
stage-3 step then grows the rank's resident memory by about one unit buffer per unit
(measured: docs/benchmarks.md, "Memory").

:func:`return_freed_memory` fixes the threshold (which also turns the dynamic adjustment off),
so every block of at least that size is mapped on allocation and returned on free: the
resident set follows what is alive. The price is a page fault per touched page of each new
large block (the kernel hands out zeroed pages), the same work the first step already does.
Once stage 3's units are known, :func:`unit_threshold` raises it to the smallest unit's gathered
bytes: the unit buffers (and their full gradients and gather temporaries, at least as large) stay
mappings of their own, while activations and other transients below a unit come back from
the heap as in any PyTorch program instead of faulting in afresh every micro-batch.
On an accelerator the host holds only the snapshot copies of a save, so nothing changes there.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # <malloc.h>: mallopt parameter numbers
M_TRIM_THRESHOLD = -1
DEFAULT_THRESHOLD = 1 << 20  # bytes: every tensor of at least 1 MiB is its own mapping
MAX_THRESHOLD = 32 << 20  # glibc refuses more than HEAP_MAX / 2 (32 MiB on 64-bit)
# the largest transient ZeRO allocates per step on the CPU (a stage-2 round gradient, a piece of
# gloo's list all-gather temporary): under glibc's dynamic policy a freed block below the 32 MiB
# ceiling is reused from the heap, a larger one is a fresh mapping faulted in again every step
HEAP_REUSED_BYTES = 16 << 20
HEAP_REUSED_FP32_ELEMS = HEAP_REUSED_BYTES // 4


def return_freed_memory(threshold_bytes: int = DEFAULT_THRESHOLD) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` to ``threshold_bytes`` for this process (``mallopt``),
    so freed blocks of at least that size go back to the operating system at once. Returns
    whether it was set: False off Linux or without glibc's ``mallopt`` (e.g. musl), where
    nothing changes. Process-wide, like ``torch.set_num_threads``: call once at start-up,
    before the model is built."""
    if not sys.platform.startswith("linux"):
        return False
    if not 0 < threshold_bytes <= MAX_THRESHOLD:
        raise ValueError(f"the mmap threshold must be in (0, 32 MiB], got {threshold_bytes} bytes")
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, 2 * int(threshold_bytes)))


def unit_threshold(unit_bytes) -> int:
    """The threshold that maps exactly stage 3's per-unit buffers: ``T = min(max(min_u B_u, 1 MiB),
    32 MiB)`` for the units' gathered parameter bytes ``B_u``. Every unit's gathered parameters,
    its full gradient (``g >= p`` bytes per element) and gloo's gather temporary (the whole unit
    or a piece of ``collectives.UNIT_GATHER_ELEMS`` elements, at least 32 MiB) are ``>= T`` and
    leave the resident set when freed; a block below ``T`` (an activation, a shard's copy) is
    reused from the heap. ``unit_bytes``: an iterable of ints; empty gives 1 MiB."""
    smallest = min((int(b) for b in unit_bytes), default=DEFAULT_THRESHOLD)
    return min(max(smallest, DEFAULT_THRESHOLD), MAX_THRESHOLD)
