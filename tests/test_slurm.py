"""The SLURM examples on a real SLURM: a two-node cluster started on this machine.

Where the machine allows it (Linux, root, Debian's packages reachable when SLURM is missing, and
``MEGAZERO_SKIP_SLURM`` unset) the module fixture

1. installs ``slurm-wlm`` and ``munge`` with ``apt-get install --no-install-recommends`` when
   ``slurmctld`` is missing (about 10 s);
2. writes a munge key and a ``slurm.conf`` into a temp dir (free ports, ``SlurmUser=root``,
   ``select/cons_tres``, ``proctrack/linuxproc``, ``task/none``, no cgroups, no accounting, state
   and spool dirs in the temp dir) declaring two nodes, ``mz1`` and ``mz2``, both this host
   (``NodeHostname``, ``NodeAddr=127.0.0.1``) with their own ``Port`` and ``%n``-named spool,
   pid and log files; each declares 8 CPUs with ``SlurmdParameters=config_overrides`` so 4 tasks
   fit on a 2-core box. It starts ``munged``, ``slurmctld`` and two ``slurmd -N mz1`` /
   ``slurmd -N mz2`` in the foreground as children of the test (Debian's build runs two slurmd
   on one host this way);
3. kills them all and removes the temp dir afterwards, whatever happened.

The tests submit ``examples/slurm/*.sbatch`` with ``sbatch --nodes=2`` (command-line options
override the scripts' ``#SBATCH`` GPU sizes), a tiny CPU GPT through ``GPT_ARGS`` and gloo, and
check the Megatron iteration lines in the job's output and ``latest_checkpointed_iteration.txt``.
The emulated node names do not resolve, so the jobs get ``MASTER_ADDR`` / ``RDZV_HOST`` =
127.0.0.1 (on a real cluster the scripts take the first host of the allocation).
The srun test also proves preemption: it sends SIGUSR1 to the batch shell (what
``--signal=B:USR1@120`` does before the time limit), expects the ranks to checkpoint, the script
to ``scontrol requeue`` the job, and the requeued job (same id, same run dir) to resume with
``--load`` and finish. SLURM holds a requeued job for ~2 minutes (``BeginTime``); the test
releases it at once with ``scontrol update StartTime=now``.

Elsewhere the tests are skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = ROOT / "examples" / "slurm"
ITER_RE = re.compile(r"^(?: \[[^\]]*\])? iteration\s+(\d+)/\s*(\d+) \|.*\| lm loss: ([0-9.eE+-]+) \|", re.M)
TINY_GPT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 128 "
            "--log-interval 1 --eval-interval 1000 --eval-iters 0 --distributed-backend gloo")


def _run(cmd, env=None, timeout=60, check=True) -> str:
    out = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} -> {out.returncode}\n{out.stdout}{out.stderr}")
    return out.stdout


def _skip_reason() -> str | None:
    """Why this machine cannot host the test cluster, or None; installs SLURM when missing."""
    if os.environ.get("MEGAZERO_SKIP_SLURM"):
        return "MEGAZERO_SKIP_SLURM is set"
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root to start slurmd and munged"
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge missing and no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=300).returncode:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=120)
            out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
            if out.returncode:
                tail = " | ".join((out.stdout + out.stderr).strip().splitlines()[-2:])
                return f"apt-get install slurm-wlm munge failed (Debian packages unreachable?): {tail}"
    except subprocess.TimeoutExpired:
        return "apt-get install slurm-wlm munge timed out"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


NODES = ("mz1", "mz2")


class Cluster:
    """munged + slurmctld + one slurmd per emulated node on this host, configured and owned by the test."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []
        self.host = socket.gethostname().split(".")[0]
        self.env = dict(os.environ, SLURM_CONF=str(tmp / "slurm.conf"))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(k, None)

    def _daemon(self, name: str, cmd: list) -> None:
        log = open(self.tmp / f"{name}.out", "w")
        self.procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)))

    def start(self) -> "Cluster":
        t = self.tmp
        os.chmod(t, 0o755)
        key = t / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = t / "munge.sock"
        self._daemon("munged", ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                                f"--pid-file={t}/munged.pid", f"--log-file={t}/munged.log",
                                f"--seed-file={t}/munged.seed"])
        for _ in range(50):
            if sock.exists():
                break
            time.sleep(0.1)
        self._write_conf(sock)
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(t / "slurm.conf")])
        for name in NODES:
            self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(t / "slurm.conf")])
        deadline = time.time() + 30
        while time.time() < deadline:
            state = _run(["sinfo", "-h", "-N", "-o", "%T"], self.env, check=False).split()
            if state == ["idle"] * len(NODES):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster did not come up (node states {state!r})\n{self.logs()}")

    def _write_conf(self, sock: Path) -> None:
        t = self.tmp
        ctld_port, d_port, *node_ports = _free_ports(2 + len(NODES))
        (t / "state").mkdir()
        (t / "spool").mkdir()
        nodes = ""
        for name, port in zip(NODES, node_ports):  # two slurmd on this host: own name, port, spool
            (t / "spool" / name).mkdir(parents=True)
            nodes += (f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} CPUs=8 Sockets=1 "
                      f"CoresPerSocket=8 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN\n")
        conf = f"""\
ClusterName=megazero-test
SlurmctldHost={self.host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/%n
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd-%n.pid
SlurmctldLogFile={t}/slurmctld.log
SlurmdLogFile={t}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
{nodes}PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        (t / "slurm.conf").write_text(conf)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log"))
                         if p.stat().st_size)

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # ---- jobs ------------------------------------------------------------------------
    def sbatch(self, script: Path, options: list, env: dict) -> int:
        out = _run(["sbatch", "--parsable", *options, str(script)], dict(self.env, **env))
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        text = _run(["scontrol", "-o", "show", "job", str(job_id)], self.env, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_done(self, job_id: int, timeout: float, release_requeued: bool = True) -> dict:
        """Poll until the job has finished; a requeued (held) job is released at once."""
        deadline, held_since = time.time() + timeout, None
        while time.time() < deadline:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            if release_requeued and state == "PENDING" and info.get("Reason") == "BeginTime":
                # slurmd revokes the old run's credential with 1 s resolution: a relaunch within
                # the same second is refused ("Job credential revoked"), so wait a little first.
                held_since = held_since or time.time()
                if time.time() - held_since > 3:
                    _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], self.env, check=False)
                    held_since = None
            time.sleep(0.5)
        _run(["scancel", str(job_id)], self.env, check=False)
        raise AssertionError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s\n{self.logs()}")


@pytest.fixture(scope="module")
def cluster():
    reason = _skip_reason()
    if reason:
        pytest.skip(f"SLURM test skipped: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="megazero-slurm-"))
    c = Cluster(tmp)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _job_env(run_root: Path, gpt_args: str) -> dict:
    # the emulated nodes' names do not resolve: the rendezvous is this host's loopback
    return {"MEGAZERO_DIR": str(ROOT), "PYTHON": sys.executable, "RUN_ROOT": str(run_root),
            "GPT_ARGS": gpt_args, "MASTER_ADDR": "127.0.0.1", "RDZV_HOST": "127.0.0.1"}


def _iterations(log: str) -> list[int]:
    return [int(m.group(1)) for m in ITER_RE.finditer(log)]


def _explain(log: str, cluster: Cluster) -> str:
    return f"--- job output\n{log[-6000:]}\n{cluster.logs()}"


def test_srun_sbatch_trains_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """2 nodes x 2 ranks (TP 2 in a node x DP 2 across) by srun; SIGUSR1 mid-run -> checkpoint,
    requeue, resume, finish."""
    iters = 60
    out = tmp_path / "job.out"
    job = cluster.sbatch(SLURM_DIR / "pretrain_gpt.sbatch",
                         ["--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                          "--time=10", f"--output={out}", "--job-name=mz-srun"],
                         _job_env(tmp_path, f"{TINY_GPT} --train-iters {iters} --tensor-model-parallel-size 2"))
    deadline = time.time() + 90  # the first iteration line, then "preempt"
    while time.time() < deadline and not _iterations(out.read_text() if out.exists() else ""):
        if cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"):
            break
        time.sleep(0.05)
    log = out.read_text() if out.exists() else ""
    assert _iterations(log), f"no iteration line from job {job}\n{_explain(log, cluster)}"
    _run(["scancel", "--batch", "--signal=USR1", str(job)], cluster.env)
    info = cluster.wait_done(job, timeout=120)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _explain(log, cluster)
    assert info["NodeList"] == "mz[1-2]" and "4 tasks" in log, _explain(log, cluster)
    assert int(info["Restarts"]) == 1, (f"job was not requeued once (Restarts={info.get('Restarts')}; if training "
                                        f"ended before SIGUSR1 arrived, raise `iters`)\n{_explain(log, cluster)}")
    assert "SIGUSR1" in log and f"requeueing job {job}" in log, _explain(log, cluster)
    m = re.search(r"loaded checkpoint from (\S+) at iteration (\d+)", log)
    assert m, f"the requeued job did not resume from its checkpoint\n{_explain(log, cluster)}"
    resumed_at = int(m.group(2))
    assert 1 <= resumed_at < iters, _explain(log, cluster)
    seen = _iterations(log)
    assert seen[-1] == iters and seen.count(resumed_at + 1) == 1, _explain(log, cluster)
    assert set(seen) == set(range(1, iters + 1)), _explain(log, cluster)  # no gap, none done twice after the save
    run_dir = tmp_path / f"mz-srun-{job}"
    assert Path(m.group(1)) == run_dir / "checkpoints"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    print(f"--- job {job} output ({out})\n{log}")  # shown by pytest -rP / -s


def test_torchrun_sbatch_trains_and_checkpoints(cluster, tmp_path):
    """One torchrun per node under srun on 2 nodes, 2 ranks each (TP 2 x DP 2), c10d rendezvous."""
    iters = 4
    out = tmp_path / "job.out"
    env = dict(_job_env(tmp_path, f"{TINY_GPT} --train-iters {iters} --tensor-model-parallel-size 2"),
               NPROC_PER_NODE="2")
    job = cluster.sbatch(SLURM_DIR / "pretrain_gpt_torchrun.sbatch",
                         ["--nodes=2", "--cpus-per-task=2", "--gpus-per-node=0", "--time=10",
                          f"--output={out}", "--job-name=mz-torchrun"], env)
    info = cluster.wait_done(job, timeout=120, release_requeued=False)
    log = out.read_text() if out.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _explain(log, cluster)
    assert _iterations(log) == list(range(1, iters + 1)), _explain(log, cluster)
    assert info["NodeList"] == "mz[1-2]" and "2 nodes x 2 ranks" in log, _explain(log, cluster)
    ckpt = tmp_path / f"mz-torchrun-{job}" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert (ckpt / f"iter_{iters:07d}").is_dir()
    print(f"--- job {job} output ({out})\n{log}")
