"""Restart without a human on SLURM (issue 46, item 4): under examples/slurm/pretrain_gpt.sbatch a
rank SIGKILLed mid-interval ends the step (``srun --kill-on-bad-exit``), the script requeues the
job by itself, and the requeued job (``SLURM_RESTART_COUNT=1``) resumes from the latest complete
checkpoint and ends with the uninterrupted run's losses. On the two-node cluster of
tests/test_slurm.py (one rank per node, DP 2), where that machine allows it; skipped elsewhere."""

import re
import sys
import time

from tests.faults.test_restart import FLAGS, ROOT, logged, torchrun
from tests.test_slurm import SLURM_DIR, cluster  # noqa: F401  (the module's two-node cluster fixture)


def test_a_killed_rank_requeues_the_job_which_resumes_and_ends_with_the_uninterrupted_losses(cluster, tmp_path):
    out = tmp_path / "job.out"
    env = {"MEGAZERO_DIR": str(ROOT), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "RUN_ROOT": str(tmp_path),
           "GPT_ARGS": " ".join(FLAGS), "MASTER_ADDR": "127.0.0.1", "TRAIN_SCRIPT": "tests/faults/kill_rank.py",
           "MEGAZERO_TEST_KILL": "1:5:2"}  # rank 1 dies in iteration 6, in the first attempt only
    job = cluster.sbatch(SLURM_DIR / "pretrain_gpt.sbatch",
                         ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10",
                          f"--output={out}", "--job-name=mz-kill"], env)
    t0 = time.time()
    info = cluster.wait_done(job, timeout=240)  # releases the requeued job's ~2-minute hold at once
    log = out.read_text() if out.exists() else ""
    explain = f"--- job output\n{log[-6000:]}\n{cluster.logs()}"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and int(info["Restarts"]) == 1, explain
    assert re.search(r"the step failed with \d+ \(failure 1 in a row without a new checkpoint", log), explain
    ck = tmp_path / f"mz-kill-{job}" / "checkpoints"
    assert (f"> restart: SLURM requeue 1 (SLURM_RESTART_COUNT=1): resumed from --load {ck} at iteration 3 "
            "(24 samples); the previous attempt had logged iteration 5: iterations 4-5 are redone") in log, explain
    code, ref = torchrun([str(ROOT / "pretrain_gpt.py"), *FLAGS, "--save", str(tmp_path / "ref")], tmp_path, 0)
    assert code == 0 and logged(log) == logged(ref) and sorted(logged(ref)) == list(range(1, 9)), explain
    print(f"--- job {job} ({time.time() - t0:.0f} s)\n{log}")
