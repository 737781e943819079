"""--mtp-num-layers / --mtp-loss-scaling-factor (megazero/config/mtp_flags.py) and DeepSeek-V3's
router flags: parsed into GPTConfig with Megatron's names; every layout that cannot place the MTP
layers, and every bad expert-group setting, one ``pretrain_gpt.py: error:`` line before any
process group. In-process: no process group is created."""

import warnings

import pytest

from megazero.training.build import build_configs
from tests.megatron.test_moe_flags import BASE, MOE, parse, refused

ROPE = ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]


def test_flags_reach_the_config_and_checkpoint_args():
    c = build_configs(parse(BASE + ROPE + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
                                           "--pipeline-model-parallel-size", "2"]))
    assert (c.model.mtp_num_layers, c.model.mtp_loss_scaling_factor) == (2, 0.3)
    assert c.model.to_args()["mtp_num_layers"] == 2
    assert build_configs(parse(BASE)).model.mtp_num_layers is None


@pytest.mark.parametrize("extra,needle", [
    (["--mtp-num-layers", "0"], "--mtp-num-layers must be >= 1, got 0"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--position-embedding-type", "rope"],
     "needs --untie-embeddings-and-output-weights"),
    (["--mtp-num-layers", "1"], "needs --position-embedding-type rope (got learned_absolute)"),
    (ROPE + ["--mtp-num-layers", "1", "--context-parallel-size", "2"], "--context-parallel-size 2"),
    (["--mtp-use-repeated-layer"], "--mtp-use-repeated-layer"),
    (["--mtp-num-layers", "1", "--calculate-per-token-loss"], "--calculate-per-token-loss"),
    (ROPE + ["--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "2"],
     "--mtp-num-layers 1 with --recompute-method uniform --recompute-num-layers 2: megatron-core 0.16.1"),
    (ROPE + ["--mtp-num-layers", "2", "--recompute-granularity", "full", "--recompute-num-layers", "4"],
     "--mtp-num-layers 2 with --recompute-granularity full --recompute-num-layers 4"),
])
def test_mtp_layouts_refused_in_one_line(capsys, extra, needle):
    assert needle in refused(capsys, BASE + extra)


@pytest.mark.parametrize("method,n", [("uniform", "1"), ("block", "2"), ("block", "4")])
def test_mtp_recompute_of_one_layer_or_block_is_accepted(method, n):
    """Megatron's MTP recompute: uniform with one layer each; block, the MTP layers then not
    recomputed and one warning says so (``WARNING: ...`` once per job under pretrain_gpt.py)."""
    argv = BASE + ROPE + ["--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", method,
                          "--recompute-num-layers", n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = build_configs(parse(argv))
    notes = [str(w.message) for w in caught if "multi-token prediction" in str(w.message)]
    assert notes == (["--recompute-method block: the multi-token prediction layers are not recomputed (as "
                      "megatron-core 0.16.1: 'not supported for MTP yet. Skipping recompute')"]
                     if method == "block" else [])
    assert (c.model.recompute_method, c.model.recompute_num_layers) == (method, int(n))


@pytest.mark.parametrize("extra,needle", [
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "--moe-router-num-groups 3"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "--moe-router-group-topk 3"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk", "4"], "exceeds"),
    (["--moe-router-num-groups", "2"], "go together"),
])
def test_bad_expert_groups_refused_in_one_line(capsys, extra, needle):
    assert needle in refused(capsys, MOE + ["--moe-router-score-function", "sigmoid"] + extra)


def test_a_load_with_other_mtp_layers_is_refused_naming_the_flag():
    """``mtp_num_layers`` fixes weight shapes: a checkpoint's recorded value must equal the run's."""
    from megazero.model.saved_args import MODEL_KEYS, model_arg_diffs
    assert "mtp_num_layers" in MODEL_KEYS
    saved = build_configs(parse(BASE + ROPE + ["--mtp-num-layers", "1"])).model.to_args()
    now = build_configs(parse(BASE + ROPE)).model.to_args()
    assert model_arg_diffs(saved, now) == ["--mtp-num-layers: command line None, checkpoint 1"]
