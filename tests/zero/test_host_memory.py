"""megazero.zero.host_memory: with the mmap threshold fixed, the memory of freed large tensors
goes back to the operating system even where glibc's heap would keep it (small allocations
after them pin the heap's top), as ZeRO-3's per-unit buffers need. Each case runs in a fresh
interpreter: the setting is process-wide and depends on the allocator's history."""

import json
import os
import subprocess
import sys

import pytest

from megazero.zero.host_memory import return_freed_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHURN = """
import json, sys, torch
from megazero.zero.host_memory import return_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
ok = return_freed_memory() if sys.argv[1] == "fixed" else None
warm = torch.empty(2 << 20)  # 8 MiB, mmapped and freed: glibc's dynamic threshold rises to 8 MiB
del warm
big, small = [], []
for _ in range(64):
    big.append(torch.ones(1 << 20))  # 4 MiB, touched
    small.append(torch.ones(1 << 17))  # 512 KiB after it (no older hole fits it), kept
before, freed = rss(), sum(t.nbytes for t in big)
del big
print(json.dumps([ok, freed, before - rss()]))
"""


def _churn(policy: str):
    """(set?, bytes freed, resident bytes given back) of 64 freed 4 MiB tensors."""
    out = subprocess.run([sys.executable, "-c", CHURN, policy], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_leave_the_resident_set():
    ok, freed, returned = _churn("fixed")
    assert ok and returned >= 0.9 * freed
    _, freed, kept = _churn("default")  # glibc's default keeps them: why the setting exists
    assert kept < 0.5 * freed


def test_threshold_beyond_glibc_limit_is_refused():
    with pytest.raises(ValueError, match="mmap threshold"):
        return_freed_memory(64 << 20)
