"""megazero.zero.host_memory: with the mmap threshold fixed, the memory of freed large tensors
goes back to the operating system even where glibc's heap would keep it (small allocations
after them pin the heap's top), as ZeRO-3's per-unit buffers need; raised to the smallest
unit, smaller blocks are reused from the heap. Each case runs in a fresh
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


def _fresh(script: str, policy: str):
    """The JSON last printed by ``script`` run with ``policy`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", script, policy], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _churn(policy: str):
    """(set?, bytes freed, resident bytes given back) of 64 freed 4 MiB tensors."""
    return _fresh(CHURN, policy)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_leave_the_resident_set():
    ok, freed, returned = _churn("fixed")
    assert ok and returned >= 0.9 * freed
    _, freed, kept = _churn("default")  # glibc's default keeps them: why the setting exists
    assert kept < 0.5 * freed


REUSE = """
import json, resource, sys, torch
from megazero.zero.host_memory import return_freed_memory, unit_threshold
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ok = return_freed_memory(unit_threshold([8 << 20, 4 << 20]) if sys.argv[1] == "unit" else 1 << 20)
for _ in range(2):  # warm: the heap grows once
    act = torch.ones(1 << 19); del act
f0 = faults()
for _ in range(20):  # an activation of 2 MiB, allocated, touched and freed every micro-batch
    act = torch.ones(1 << 19); del act
refaulted = faults() - f0
keep = torch.ones(1 << 10)
before = rss()
unit = torch.ones(1 << 20)  # a 4 MiB unit buffer, gathered and freed
del unit
print(json.dumps([ok, refaulted, rss() - before]))
"""


def _reuse(policy: str):
    """(set?, pages re-faulted by 20 freed 2 MiB blocks, resident bytes a freed 4 MiB unit keeps)."""
    return _fresh(REUSE, policy)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_unit_threshold_maps_units_and_reuses_smaller_blocks():
    """Stage 3's policy once its units exist (``unit_threshold``): a freed unit-sized buffer
    leaves the resident set, while a smaller activation freed every micro-batch comes back from
    the heap without faulting its pages in again (at 1 MiB each reuse faults 512 pages)."""
    ok, refaulted, kept = _reuse("unit")
    assert ok and refaulted <= 4 * 512 and kept < (1 << 20)  # at most a few of the 20 (heap placement varies)
    _, refaulted_1mib, _ = _reuse("1mib")
    assert refaulted_1mib >= 16 * 512  # why the threshold is raised


def test_unit_threshold_bounds():
    from megazero.zero.host_memory import DEFAULT_THRESHOLD, MAX_THRESHOLD, unit_threshold
    assert unit_threshold([12 << 20, 3 << 20]) == 3 << 20
    assert unit_threshold([]) == unit_threshold([4096]) == DEFAULT_THRESHOLD
    assert unit_threshold([100 << 20]) == MAX_THRESHOLD


def test_threshold_beyond_glibc_limit_is_refused():
    with pytest.raises(ValueError, match="mmap threshold"):
        return_freed_memory(64 << 20)


def _region_sizes(rank, world):
    import torch
    from megazero.parallel.topology import Topology
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank).create_groups()
    out = {}
    for stage in (1, 2):
        model = torch.nn.Sequential(*[torch.nn.Linear(1200, 1200, bias=False) for _ in range(3)])  # 4.32 M
        opt = ZeroOptimizer(model, topo, stage=stage, num_micro_batches=1, lr=1e-3,
                            reduce_bucket_size=500_000_000)  # DeepSpeed's default: one bucket of everything
        out[stage] = [r.numel for r in opt.regions]
    return out


def test_stage2_round_gradients_stay_below_glibc_mmap_ceiling_on_the_cpu():
    """At stage 2 every round frees its full gradient; on the CPU the regions are cut at
    HOST_ROUND_ELEMS (16 MiB of fp32) so that glibc reuses the freed blocks instead of mapping
    (and faulting in) a fresh one per step; stage 1 keeps its gradient and the one bucket."""
    from megazero.testing import run_distributed
    from megazero.zero.regions import HOST_ROUND_ELEMS, round_bucket_size
    sizes = run_distributed(_region_sizes, 2)[0]
    assert sizes[1] == [3 * 1200 * 1200]
    assert len(sizes[2]) == 2 and sum(sizes[2]) == 3 * 1200 * 1200 and max(sizes[2]) <= HOST_ROUND_ELEMS
    assert round_bucket_size(2, 500_000_000, "cuda") == 500_000_000  # an accelerator keeps the flag's bucket


def test_the_flag_selects_the_policy_and_a_bad_value_is_refused(capsys):
    """``--zero-host-memory-policy``: speed (default) fixes 1 MiB and raises it to the smallest unit
    at stage 3 and leaves glibc's policy at stages 0-2; tight fixes 1 MiB at every stage for good."""
    from megazero.arguments import parse_args
    from megazero.training.build import build_configs, host_memory_plan
    from tests.faults.common import MOCK, TINY

    def plan(*extra):
        config = build_configs(parse_args(TINY + MOCK + ["--train-iters", "1"] + list(extra), world_size=1))
        return config.host_memory_policy, host_memory_plan(config)
    assert plan("--zero-stage", "3") == ("speed", (True, True))
    assert plan("--zero-stage", "2") == ("speed", (False, False))
    assert plan("--zero-stage", "3", "--zero-host-memory-policy", "tight") == ("tight", (True, False))
    assert plan("--zero-stage", "1", "--zero-host-memory-policy", "tight") == ("tight", (True, False))
    with pytest.raises(SystemExit) as exc:
        parse_args(TINY + MOCK + ["--train-iters", "1", "--zero-host-memory-policy", "fast"], world_size=1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "error: argument --zero-host-memory-policy: invalid choice: 'fast'" in lines[-1]


POLICY = """
import json, resource, sys, torch
from megazero.arguments import parse_args
from megazero.training import setup
argv = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "4096",
        "--distributed-backend", "gloo", "--zero-stage", "3", "--zero-host-memory-policy", sys.argv[1]]
trainer = setup(parse_args(argv, world_size=1))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # warm: the heap grows once
    act = torch.ones(1 << 19); del act
f0 = faults()
for _ in range(20):  # a 2 MiB activation, allocated, touched and freed every micro-batch
    act = torch.ones(1 << 19); del act
print(json.dumps([min(trainer.optimizer.gatherer.unit_bytes()), faults() - f0]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_setup_applies_the_flags_policy():
    """A ZeRO-3 run whose smallest unit is ~3 MiB: under speed a freed 2 MiB block is reused from
    the heap (threshold at the unit), under tight it is a fresh mapping faulted in every time."""
    smallest, speed = _fresh(POLICY, "speed")
    _, tight = _fresh(POLICY, "tight")
    # speed: the block comes back from the heap (0 faults in most runs; a run whose heap top sits above the
    # trim threshold re-faults a few of the 20: 2560 seen); tight: every one of the 20 is faulted in
    assert smallest > 2 << 20 and speed <= tight // 2 and tight >= 16 * 512, (smallest, speed, tight)
