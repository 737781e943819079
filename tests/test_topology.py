"""The rank grid (Megatron order), the groups' JSON CLI, and real groups on 8 forked ranks."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megazero.testing import RankFailure, RankTimeout, run_distributed
from megazero.parallel.layout import layout
from megazero.parallel.topology import Topology


def test_megatron_documented_groups_world16_tp2_pp4():
    g = layout(16, tp=2, pp=4)
    assert [0, 1] in g["tp"] and len(g["tp"]) == 8
    assert [0, 2] in g["dp"] and len(g["dp"]) == 8
    assert [0, 4, 8, 12] in g["pp"] and len(g["pp"]) == 4
    assert [0, 12] in g["embedding"]
    assert [0, 1, 4, 5, 8, 9, 12, 13] in g["model_parallel"]
    assert g["position_embedding"][0] == [0]
    t = Topology(16, 13, tp=2, pp=4)
    assert (t.tp_rank, t.dp_rank, t.pp_rank, t.dp) == (1, 0, 3, 2)
    assert t.rank_lists["embedding"] == [1, 13] and t.is_last_stage
    assert t.next_rank == 1 and t.prev_rank == 9  # wraps around for virtual stages


def test_every_rank_in_exactly_one_group_per_kind():
    for world, tp, pp in [(8, 2, 2), (8, 1, 8), (12, 2, 3), (1, 1, 1)]:
        g = layout(world, tp, pp)
        for kind in ("tp", "dp", "pp", "model_parallel"):
            flat = sorted(r for ranks in g[kind] for r in ranks)
            assert flat == list(range(world)), kind
        for rank in range(world):
            t = Topology(world, rank, tp=tp, pp=pp)
            assert rank == t.tp_rank + tp * t.dp_rank + tp * t.dp * t.pp_rank


def test_context_and_expert_sizes_follow_megatrons_order_tp_cp_ep_dp_pp():
    """Megatron-core's RankGenerator(order="tp-cp-ep-dp-pp"): world 16, TP 2, CP 2, PP 2 -> DP 2,
    rank = tp + 2 cp + 4 dp + 8 pp; its expert grid (expert TP = TP) tp-ep-dp-pp: EP 2 takes
    consecutive runs of the DP x CP ranks of a (PP, TP) position ([0, 2], [4, 6])."""
    g = layout(16, tp=2, pp=2, cp=2, ep=2)
    assert [0, 1] in g["tp"] and [0, 2] in g["cp"] and [0, 4] in g["dp"] and [0, 8] in g["pp"]
    assert [0, 2] in g["ep"] and [4, 6] in g["ep"] and [1, 3] in g["ep"] and len(g["ep"]) == 8
    assert [0, 1, 8, 9] in g["model_parallel"] and [0, 8] in g["embedding"]
    for kind in ("tp", "cp", "dp", "pp", "ep", "model_parallel"):
        assert sorted(r for ranks in g[kind] for r in ranks) == list(range(16)), kind
    t = Topology(16, 14, tp=2, pp=2, cp=2, ep=2)
    assert (t.tp_rank, t.cp_rank, t.dp_rank, t.pp_rank, t.ep_rank, t.dp) == (0, 1, 1, 1, 1, 2)
    assert t.rank_lists["cp"] == [12, 14] and t.rank_lists["ep"] == [12, 14] and t.rank_lists["dp"] == [10, 14]
    assert "cp 1/2 ep 1/2" in t.describe()


def test_sizes_one_of_cp_and_ep_change_nothing():
    """CP = EP = 1 is the 3D grid exactly: same groups, no cp/ep kinds to create."""
    for world, tp, pp in [(8, 2, 2), (12, 2, 3), (1, 1, 1)]:
        assert layout(world, tp, pp, cp=1, ep=1) == layout(world, tp, pp)
        assert "cp" not in layout(world, tp, pp) and "ep" not in layout(world, tp, pp)
    with pytest.raises(ValueError, match=r"expert TP 2 x EP 3 = 6 does not divide the 8 ranks"):
        layout(8, tp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match="TP 2 x CP 3 x PP 1"):
        layout(8, tp=2, cp=3)


def test_layout_rejects_indivisible_world():
    with pytest.raises(ValueError, match="world size 8 is not divisible by TP 3"):
        layout(8, tp=3)


def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "megazero.parallel.topology", "--world-size", "16",
                          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
                         capture_output=True, text=True, check=True)
    groups = json.loads(out.stdout)
    assert set(groups) >= {"tp", "dp", "pp", "model_parallel", "embedding"}
    assert groups["embedding"][0] == [0, 12]
    bad = subprocess.run([sys.executable, "-m", "megazero.parallel.topology", "--world-size", "6",
                          "--tensor-model-parallel-size", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not divisible" in bad.stderr


def _group_sums(rank, world_size, tp, pp):
    topo = Topology(world_size, rank, tp=tp, pp=pp).create_groups()
    other = Topology(world_size, rank, tp=pp, pp=tp)  # a second topology coexists (no globals)
    sums = {}
    for kind in ("tp", "dp", "pp", "model_parallel", "embedding"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=topo.group(kind))
        sums[kind] = t.item()
    return sums, topo.rank_lists, other.rank_lists["tp"]


def test_real_groups_all_reduce_on_8_ranks():
    results = run_distributed(_group_sums, 8, 2, 2)
    for rank, (sums, lists, other_tp) in enumerate(results):
        for kind, total in sums.items():
            assert total == sum(lists[kind]), (rank, kind)
        assert rank in other_tp
    # rank 5 = tp 1, dp 0, pp 1 in an (TP 2, PP 2, DP 2) grid
    assert results[5][1]["tp"] == [4, 5] and results[5][1]["dp"] == [5, 7] and results[5][1]["pp"] == [1, 5]
    assert results[5][1]["embedding"] == [1, 5]


def _v_embedding_groups(rank, world_size):
    topo = Topology(world_size, rank, pp=4, vp=2, pipeline_schedule="zbv").create_groups()
    group = topo.embedding_group
    return None if group is None else dist.get_process_group_ranks(group)


def test_embedding_group_with_the_v_is_pipeline_rank_0_alone():
    """With the V the first and the last stage are both on pipeline rank 0 (one tied weight
    there, ``megazero.model.stages.shared_embedding_params``): its embedding group is that rank
    alone; the other ranks, PP - 1 included, are in none."""
    assert run_distributed(_v_embedding_groups, 4) == [[0], None, None, None]


def _fails_on_rank_2(rank, world_size):
    if rank == 2:
        raise ValueError("injected failure")
    dist.barrier()


def _sleeps(rank, world_size):
    import time
    time.sleep(60)


def test_harness_reports_failing_rank_and_kills_on_timeout():
    with pytest.raises(RankFailure, match=r"first: rank 2") as exc:
        run_distributed(_fails_on_rank_2, 4, grace_s=2)
    assert "injected failure" in str(exc.value)
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] of 2 did not finish"):
        run_distributed(_sleeps, 2, timeout_s=1.5)


def test_expert_grid_with_its_own_tensor_parallel_size():
    """Megatron's expert RankGenerator(tp=ETP, ep=EP, dp=EDP, pp, order="tp-ep-dp-pp"): world 8,
    TP 2, PP 2, EP 2, ETP 1 -> EDP 2 per stage: the TP pairs exchange tokens, each rank its own
    expert shard, expert gradients reduced over the stage's ranks 2 apart."""
    g = layout(8, tp=2, pp=2, ep=2, etp=1)
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["tp_ep"] == g["ep"]
    assert g["etp"] == [[r] for r in range(8)]
    assert g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    t = Topology(8, 5, tp=2, pp=2, ep=2, etp=1)
    assert (t.etp_rank, t.ep_rank, t.edp_rank, t.edp) == (0, 1, 0, 2)
    same = layout(8, tp=2, ep=2)  # ETP = TP: ep carved from DP, etp is the TP group
    assert same["etp"] == same["tp"] and same["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert same["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and same["tp_ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="expert TP 4 x EP 2"):
        layout(4, tp=2, ep=2, etp=4)
