"""A process's resident memory on Linux, for the benches' per-rank peaks.

``reset_peak()`` writes 5 to ``/proc/self/clear_refs``, which resets the kernel's high-water mark
of this process's resident set; ``peak_since_reset()`` then reads it (``ru_maxrss``): the peak of
whatever ran in between, not of what came before. ``rss_now()`` is the current resident set.
"""

from __future__ import annotations

import os
import resource


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_since_reset() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
