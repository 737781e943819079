"""Start torch.distributed from torchrun's environment, SLURM's, or as a single process.

Sources, in order:

* **torchrun** -- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``.
* **SLURM** (``srun`` one task per GPU) -- ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``; ``MASTER_ADDR`` defaults to the first
  host of ``SLURM_JOB_NODELIST`` and ``MASTER_PORT`` to 29500 + (job id mod 1000).
* Neither -- a single process (world size 1) on a private store.

The backend is NCCL with CUDA and gloo otherwise (``--distributed-backend`` overrides); each
local rank takes ``cuda:local_rank``. When ranks on a node outnumber its cores, each rank runs
one intra-op thread (8 gloo ranks on 2 cores run ~13x faster than with default threads);
otherwise the cores are divided evenly.

Every launched rank (world > 1) starts a :class:`~megazero.parallel.heartbeat.Heartbeat` on the
rendezvous store with the run's timeout: a stopped rank is named by its watchers, and SIGTERM ends
a rank blocked in a collective (``MEGAZERO_HEARTBEAT=0`` turns it off).

**Restarts.** ``torchrun --max-restarts N`` restarts the ranks of a failed attempt against the
same store (its agent hosts it at ``MASTER_PORT`` and keeps it across attempts; the workers get
``TORCHELASTIC_USE_AGENT_STORE=True``), so every key of this module -- the process group's
addresses and the heartbeats -- lives under the attempt's own prefix (:func:`attempt_prefix`):
a restarted rank never reads a killed attempt's address. Under the agent store every rank is a
client of it, as torch's own ``env://`` does (``torch/distributed/rendezvous.py:
_create_c10d_store``); otherwise rank 0 hosts the store, a new one per attempt.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero.parallel.heartbeat import Heartbeat


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``gpu[01-03,07],login1`` into host names."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            lo, _, hi = rng.partition("-")
            if hi:
                width = len(lo)
                hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{lo}{suffix}")
    return hosts


def _slurm_tasks_per_node(env) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    tpn = env.get("SLURM_TASKS_PER_NODE", "1")  # e.g. "4(x2)" or "4,3"
    return int(re.match(r"\d+", tpn).group())


def detect_launch(env=os.environ) -> LaunchEnv:
    """Read rank, sizes and rendezvous address from torchrun's or SLURM's environment."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0]
        port = int(env.get("MASTER_PORT") or 29500 + int(env.get("SLURM_JOB_ID", 0)) % 1000)
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         _slurm_tasks_per_node(env), addr, port, "slurm")
    return LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")


def restart_counts(env=os.environ) -> tuple[int, int]:
    """``(SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT)``: how often SLURM has requeued this
    job and how often torchrun has restarted this node's worker group (0 when unset)."""
    counts = []
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        value = env.get(name, "").strip() or "0"
        if not value.isdigit():
            raise ValueError(f"{name}={value!r}: expected a restart count (an integer >= 0)")
        counts.append(int(value))
    return counts[0], counts[1]


def attempt_prefix(env=os.environ) -> str:
    """The rendezvous-store prefix of this launch attempt, ``megazero/requeue<S>/attempt<T>``
    (:func:`restart_counts`): the keys of a killed attempt stay in torchrun's store, under its
    own prefix."""
    requeues, restarts = restart_counts(env)
    return f"megazero/requeue{requeues}/attempt{restarts}"


def rendezvous_store(launch: LaunchEnv, timeout: timedelta, env=os.environ) -> dist.Store:
    """This attempt's store for the process group: a private ``HashStore`` for one process; else
    the TCP store at ``MASTER_ADDR:MASTER_PORT`` -- torchrun's agent's when it says so
    (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank a client), else hosted by rank 0 -- seen
    through :func:`attempt_prefix`."""
    if launch.world_size == 1:  # one process (also `WORLD_SIZE=1 RANK=0`): no port to bind or share
        return dist.HashStore()
    agent = launch.source == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0 and not agent, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(env), store)


def threads_per_rank(local_world_size: int, cores: int | None = None, env=os.environ) -> int:
    """Intra-op threads of a CPU rank: ``OMP_NUM_THREADS`` when set (as PyTorch itself reads it;
    torchrun sets 1 when it starts several processes per node), else an even share of the node's
    cores, one at least. Leaving cores free matters to ``--async-save``, whose writer processes
    need CPU beside the ranks."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"OMP_NUM_THREADS={given!r}: expected a positive integer (threads per rank)")
        return int(given)
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0,
                     env=os.environ) -> tuple[LaunchEnv, torch.device]:
    """Initialize the default process group on this attempt's store (:func:`rendezvous_store`);
    return the launch facts and this rank's device."""
    if dist.is_initialized():  # already started (tests, or an embedding application)
        launch = detect_launch(env)
        launch = LaunchEnv(dist.get_rank(), dist.get_world_size(), launch.local_rank,
                           max(launch.local_world_size, 1), launch.master_addr, launch.master_port, "existing")
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        return launch, device
    launch = detect_launch(env)
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--distributed-backend nccl needs CUDA, which is not available; use gloo")
    if use_cuda:
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(launch.local_world_size, env=env))
    timeout = timedelta(minutes=timeout_minutes)
    store = rendezvous_store(launch, timeout, env)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=timeout, **kwargs)
    if launch.world_size > 1 and env.get("MEGAZERO_HEARTBEAT", "1") != "0":
        try:  # names a silent rank; ends a blocked one on SIGTERM
            Heartbeat(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                      timeout_s=timeout_minutes * 60, prefix=f"{attempt_prefix(env)}/heartbeat").start()
        except Exception as e:  # noqa: BLE001 - the run still has the collective timeouts
            print(f"rank {launch.rank}: heartbeat not started ({e}); a stalled rank is reported by the "
                  "collective timeout only", flush=True)
    return launch, device
