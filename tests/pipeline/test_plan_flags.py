"""``--pipeline-schedule``: derived values and the one-line refusals, before any process group."""

import pytest

from megazero.arguments import parse_args
from megazero.config.pipeline_flags import SCHEDULE_NAMES
from megazero.pipeline import SCHEDULES
from megazero.training.build import build_configs

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--vocab-size", "128", "--mock-data", "--pipeline-model-parallel-size", "4",
        "--untie-embeddings-and-output-weights"]


def parse(extra, gbs=8):
    return parse_args(BASE + ["--global-batch-size", str(gbs)] + list(extra), world_size=4, prog="pretrain_gpt.py")


def test_names_agree_with_the_plans():
    assert SCHEDULE_NAMES == tuple(SCHEDULES)


def test_v_schedules_imply_two_chunks_and_reach_the_topology():
    for name in ("zbv", "dualpipev"):
        args = parse(["--pipeline-schedule", name])
        assert args.virtual_pipeline_model_parallel_size == 2
        par = build_configs(args).parallel
        assert (par.vp, par.pipeline_schedule) == (2, name)
    assert parse(["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1"]) \
        .virtual_pipeline_model_parallel_size == 2
    assert parse(["--pipeline-schedule", "zb-h1"]).virtual_pipeline_model_parallel_size is None
    args = parse(["--pipeline-schedule", "interleaved-zb", "--num-layers-per-virtual-pipeline-stage", "1"])
    assert args.virtual_pipeline_model_parallel_size == 2
    assert parse([]).pipeline_schedule is None


@pytest.mark.parametrize("extra,gbs,needle", [
    (["--pipeline-schedule", "interleaved-zb"], 8, "--pipeline-schedule interleaved-zb needs virtual stages"),
    (["--pipeline-schedule", "zb-h1", "--num-layers-per-virtual-pipeline-stage", "1"], 8,
     "--pipeline-schedule zb-h1 runs one chunk per rank: drop --num-layers-per-virtual-pipeline-stage 1"),
    (["--pipeline-schedule", "zbv", "--num-layers", "12"], 8,
     "--num-layers 12 does not fold into the V of 2 x --pipeline-model-parallel-size 4 = 8 stages"),
    (["--pipeline-schedule", "zbv", "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "1"], 8,
     "needs exactly 2 chunks per rank: --num-layers-per-virtual-pipeline-stage must be 2"),
    (["--pipeline-schedule", "dualpipev"], 6, "needs at least 2 x --pipeline-model-parallel-size = 8 micro-batches"),
    (["--pipeline-schedule", "interleaved-zb", "--num-layers-per-virtual-pipeline-stage", "1"], 11,
     "multiple of max(1, M // PP) = 2"),
    (["--pipeline-schedule", "dualpipe"], 8, "keeps two copies of every stage's parameters"),
    (["--pipeline-schedule", "gpipe"], 8, "unknown schedule; choose one of 1f1b, interleaved-1f1b"),
])
def test_one_line_refusals(capsys, extra, gbs, needle):
    with pytest.raises(SystemExit) as exc:
        parse(extra, gbs)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("pretrain_gpt.py: error:") and needle in err, err


def test_every_batch_size_of_a_schedule_is_checked(capsys):
    """A step batch-size schedule whose first size gives 4 micro-batches: too few for dualpipev at PP 4."""
    argv = BASE + ["--pipeline-schedule", "dualpipev", "--train-samples", "2000", "--step-batch-size-schedule", "0:4 1K:8"]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4, prog="pretrain_gpt.py")
    assert "needs at least 2 x --pipeline-model-parallel-size = 8 micro-batches, got 4" in capsys.readouterr().err
    parse_args(BASE + ["--pipeline-schedule", "dualpipev", "--train-samples", "2000", "--step-batch-size-schedule",
                       "0:8 1K:16"], world_size=4, prog="pretrain_gpt.py")


def test_tied_embeddings_taken_with_the_v_mtp_refused(capsys):
    """Megatron's default (tied) GPT with zbv/dualpipev is accepted (one parameter on rank 0's two
    chunks); multi-token prediction stays refused with the V, in one line."""
    tied = [a for a in BASE if a != "--untie-embeddings-and-output-weights"] + ["--global-batch-size", "8"]
    for name in ("zbv", "dualpipev"):
        args = parse_args(tied + ["--pipeline-schedule", name], world_size=4, prog="pretrain_gpt.py")
        assert not args.untie_embeddings_and_output_weights and args.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(SystemExit):
        parse(["--pipeline-schedule", "zbv", "--mtp-num-layers", "1", "--position-embedding-type", "rope"])
    assert "--mtp-num-layers 1 with --pipeline-schedule zbv: the V placement" in capsys.readouterr().err


def test_pp1_refuses_pipelined_schedules(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE[:-3] + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "1", "--pipeline-schedule", "zb-h1"], world_size=1,
                   prog="pretrain_gpt.py")
    assert "--pipeline-schedule zb-h1 needs --pipeline-model-parallel-size > 1" in capsys.readouterr().err


def test_planner_ranks_layouts_with_the_schedules():
    """--try-pipeline-schedules: each PP > 1 layout under every schedule it can run; ZB-H1 keeps 1F1B's
    memory with a third of its bubble, the V puts embedding and head on rank 0."""
    from megazero.config.model import gpt_config
    from megazero.planner import plan
    from megazero.planner.cli import main
    from megazero.planner.presets import gpu_preset
    from megazero.planner.timing import step_time
    args = parse(["--num-layers", "16"])
    shape = gpt_config(args)
    rows = plan(shape, 4, micro_batch_size=1, global_batch_size=16, tp=1, pp=4, zero=0,
                schedules=("1f1b", "zb-h1", "zbv", "dualpipev"))
    by = {x.schedule: x for x in rows}
    assert set(by) == {"1f1b", "zb-h1", "zbv", "dualpipev"} and by["zbv"].vp == 2
    assert by["zb-h1"].activation_bytes == by["1f1b"].activation_bytes
    gpu = gpu_preset("h100", None, None)
    t = {k: step_time(shape, x, gpu, 1, 0.45) for k, x in by.items()}
    assert t["zb-h1"].bubble == pytest.approx(t["1f1b"].bubble / 3)
    assert t["zbv"].bubble == pytest.approx(t["1f1b"].bubble / 6)
    assert by["zbv"].stage == 0  # rank 0 holds both ends of the V
    assert main(["--num-layers", "16", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--micro-batch-size", "1", "--vocab-size", "128", "--world-size", "4", "--pipeline-model-parallel-size",
                 "4", "--try-pipeline-schedules", "--top", "3"]) == 0
