"""A zbv checkpoint (the V: rank 0 holds layers 0 and 3 of 4, rank 1 layers 1-2) loads into a 1f1b
run (rank 0 layers 0-1) and back: checkpoints hold every parameter under its global name, so the
chunk placement is one more layout change for the resharding load. The losses after loading are
the uninterrupted zbv run's (fp32, rtol 1e-5): the schedule changes no arithmetic."""

import numpy as np
import torch

from megazero.checkpoint.reader import KINDS, CheckpointReader
from megazero.inference.load_model import load_model
from tests.checkpoint.test_reshard import BASE, run, train_reference

WORD = "embedding.word_embeddings.weight"
FLAGS = BASE + ["--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "2"]
ZBV = FLAGS + ["--pipeline-schedule", "zbv"]


def test_zbv_checkpoint_loads_at_1f1b_and_back(tmp_path):
    src, ref = train_reference(tmp_path, "V", 2, ZBV)
    saved = CheckpointReader(str(src), 3)
    assert saved.args["pipeline_schedule"] == "zbv" and saved.layout["virtual_pipeline_model_parallel_size"] == 2
    at_1f1b = tmp_path / "B"
    hist = run(2, FLAGS + ["--load", str(src)], save_at_load=str(at_1f1b))
    assert [it for it, _ in hist] == [4, 5, 6]
    np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5)
    again = CheckpointReader(str(at_1f1b))
    assert sorted(saved.param_names()) == sorted(again.param_names())  # (listed in the ranks' chunk order)
    for name in saved.param_names():
        for kind in KINDS:
            assert torch.equal(saved.full_param(name, kind), again.full_param(name, kind)), (name, kind)
    hist = run(2, ZBV + ["--load", str(at_1f1b)])
    np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5)


def _evaluate(rank, world_size, argv):
    from megazero.arguments import parse_args
    from megazero.training import setup
    return setup(parse_args(argv, world_size=world_size)).evaluate()


def test_validation_loss_reaches_the_last_rank_with_the_v():
    """With the V the loss is on pipeline rank 0; the last rank (which prints the validation line)
    gets the same value as a 1f1b run's last rank (same initial weights, same batches)."""
    from megazero.testing import run_distributed
    flags = FLAGS + ["--eval-iters", "2", "--eval-interval", "3", "--split", "50,50,0"]
    at_v = run_distributed(_evaluate, 2, flags + ["--pipeline-schedule", "zbv"], timeout_s=240)
    at_1f1b = run_distributed(_evaluate, 2, flags, timeout_s=240)
    assert at_v[-1] is not None and at_v[0] == at_v[-1]
    np.testing.assert_allclose(at_v[-1], at_1f1b[-1], rtol=1e-5)


def test_every_schedule_trains_as_1f1b_through_the_flags():
    """pretrain_gpt's path (flags -> checks -> plans -> runner) at PP 2: 2 iterations of each
    schedule give 1f1b's losses (fp32, rtol 1e-5; zbv: the test above)."""
    short = FLAGS + ["--train-iters", "2"]  # (the later flag wins)
    ref = [l for _, l in run(2, short)]
    vp = ["--num-layers-per-virtual-pipeline-stage", "1"]
    for extra in (["--pipeline-schedule", "zb-h1"], ["--pipeline-schedule", "interleaved-zb"] + vp,
                  ["--pipeline-schedule", "dualpipev"]):
        np.testing.assert_allclose([l for _, l in run(2, short + extra)], ref, rtol=1e-5, err_msg=str(extra))


def test_pipeline_trace_shows_the_ws(tmp_path):
    """--pipeline-trace with zbv: both ranks' weight-gradient spans, on both chunks."""
    import json
    from tests.test_training import train
    path = tmp_path / "trace.json"
    train(2, ZBV + ["--train-iters", "3", "--pipeline-trace", str(path)])
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    ws = {(e["pid"], e["args"]["chunk"]) for e in events if e["cat"] == "weight-grad"}
    assert ws == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert sum(e["cat"] == "weight-grad" for e in events) == 2 * 2 * 4  # ranks x chunks x micro-batches


def test_tied_zbv_checkpoint_loads_at_1f1b_and_pp1_and_back(tmp_path):
    """Tied embeddings (Megatron's default) with the V (ZeRO 3, built on the meta device as
    training builds): the one weight of rank 0's two chunks is saved under
    ``embedding.word_embeddings.weight`` as in any layout; it loads into a 1f1b PP 2 run (ZeRO 0;
    its last stage reads its copy through the alias) and a PP 1 x DP 2 ZeRO 3 run, each going on
    with the uninterrupted zbv run's losses, and both their checkpoints load back into zbv (ZeRO 1)
    with the same losses (fp32, rtol 1e-5)."""
    tied = BASE + ["--pipeline-model-parallel-size", "2"]
    src, ref = train_reference(tmp_path, "V", 2, tied + ["--pipeline-schedule", "zbv", "--zero-stage", "3"])
    saved = CheckpointReader(str(src), 3)
    assert "output_layer.weight" not in saved.param_names() and saved.aliases == {"output_layer.weight": WORD}
    for name, flags in (("B", tied), ("C", BASE + ["--pipeline-model-parallel-size", "1", "--zero-stage", "3"])):
        hist = run(2, flags + ["--load", str(src)], save_at_load=str(tmp_path / name))
        np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5, err_msg=name)
        again = CheckpointReader(str(tmp_path / name))
        for kind in KINDS:
            assert torch.equal(saved.full_param(WORD, kind), again.full_param(WORD, kind)), (name, kind)
        hist = run(2, tied + ["--pipeline-schedule", "zbv", "--zero-stage", "1", "--load", str(tmp_path / name)])
        np.testing.assert_allclose([l for _, l in hist], ref[3:], rtol=1e-5, err_msg=f"{name} -> zbv")
    tokens = torch.arange(16).reshape(1, 16)  # generation's one-process load finds every weight
    torch.testing.assert_close(load_model(str(src))(tokens), load_model(str(tmp_path / "B"))(tokens), rtol=0, atol=0)
