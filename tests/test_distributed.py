"""Launch-environment detection: torchrun, SLURM (hostlists, tasks per node), single process."""

import pytest

from megazero.parallel.launch import detect_launch, expand_nodelist, threads_per_rank


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_detect_torchrun_slurm_single():
    t = detect_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.source) == (3, 8, 1, 2, "torchrun")
    s = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                       "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242"})
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (5, 8, 1, 4)
    assert s.master_addr == "gpu12" and s.master_port == 29500 + 242 and s.source == "slurm"
    one = detect_launch({})
    assert (one.rank, one.world_size, one.source) == (0, 1, "single")


def test_threads_per_rank():
    assert threads_per_rank(8, cores=2, env={}) == 1
    assert threads_per_rank(2, cores=16, env={}) == 8
    assert threads_per_rank(2, cores=16, env={"OMP_NUM_THREADS": "3"}) == 3  # the user's (or torchrun's) choice
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            threads_per_rank(1, cores=2, env={"OMP_NUM_THREADS": bad})
