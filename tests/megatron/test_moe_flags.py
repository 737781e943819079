"""Megatron-LM's MoE and expert-parallel flags (megazero/config/moe_flags.py): parsed with Megatron's
names, types and defaults into GPTConfig.moe and ParallelConfig.ep/etp; every bad combination one
``pretrain_gpt.py: error:`` line naming the flag, before any process group; the flag table's MoE
rows each with its own reason; the Mixtral example's command line valid at EP 2 on 4 ranks.
In-process and fast: no process group is created."""

import os
import subprocess
from pathlib import Path

import pytest

from megazero.arguments import parse_args
from megazero.config.megatron_flags import megatron_flags
from megazero.moe.config import MOE_ARG_KEYS
from megazero.training.build import build_configs

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
        "--train-iters", "2", "--lr", "1e-4", "--disable-bias-linear", "--swiglu", "--ffn-hidden-size", "128"]
MOE = BASE + ["--num-experts", "4"]


def parse(argv, world_size=4, training=True):
    return parse_args(argv, world_size=world_size, prog="pretrain_gpt.py", training=training)


def refused(capsys, argv, world_size=4, training=True):
    """The one error line (status 2), without its prefix."""
    with pytest.raises(SystemExit) as exc:
        parse(argv, world_size, training)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("pretrain_gpt.py: error: "), err
    return err[len("pretrain_gpt.py: error: "):]


def test_flags_reach_the_model_and_parallel_configs():
    args = parse(MOE + ["--moe-router-topk", "1", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "([1]+[0])*2",
                        "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
                        "1e-2", "1e-3", "--moe-z-loss-coeff", "1e-3", "--moe-shared-expert-intermediate-size", "64",
                        "--moe-shared-expert-gate", "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy",
                        "position", "--moe-pad-expert-input-to-capacity", "--moe-router-dtype", "fp32",
                        "--moe-per-layer-logging", "--moe-grouped-gemm", "--expert-model-parallel-size", "2",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
                        "1"], world_size=4)
    c = build_configs(args)
    moe = c.model.moe
    assert (moe.num_experts, moe.ffn_hidden_size, moe.layer_pattern, moe.router_topk) == (4, 32, (1, 0, 1, 0), 1)
    assert moe.load_balancing == ("aux_loss", "seq_aux_loss") and moe.aux_loss_coeff == (1e-2, 1e-3)
    assert (moe.z_loss_coeff, moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (1e-3, 64, True)
    assert (moe.capacity_factor, moe.token_drop_policy, moe.pad_to_capacity) == (1.5, "position", True)
    assert (moe.router_dtype, moe.per_layer_logging, moe.token_dispatcher) == ("fp32", True, "allgather")
    assert (c.parallel.tp, c.parallel.ep, c.parallel.etp, c.parallel.dp) == (2, 2, 1, 2)
    assert c.flags["num_experts"] == 4 and c.flags["expert_tensor_parallel_size"] == 1


def test_megatron_defaults_and_derived_values():
    """Megatron's defaults (allgather dispatcher, ETP = TP, aux_loss with coefficient 0, every layer
    MoE); one-entry lists become their value; --num-experts 0 is a dense model."""
    args = parse(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-aux-loss-coeff", "0.01"])
    assert args.expert_tensor_parallel_size == 2 and args.expert_model_parallel_size == 1
    assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.01
    assert args.moe_token_dispatcher_type == "allgather" and args.moe_layer_freq == 1
    c = build_configs(args)
    assert c.model.moe.layer_pattern == (1, 1, 1, 1) and (c.parallel.ep, c.parallel.etp) == (1, 2)
    assert parse(MOE + ["--moe-layer-freq", "2"]).moe_layer_freq == 2  # Megatron's moe_freq_type: an int
    dense = parse(BASE + ["--num-experts", "0"])
    assert dense.num_experts is None and build_configs(dense).model.moe is None
    c = build_configs(parse(BASE))
    assert c.model.moe is None and c.parallel.etp == 1
    # a dense checkpoint's record holds no MoE setting (its model's to_args has num_experts None only)
    assert c.flags["num_experts"] is None and not set(MOE_ARG_KEYS[1:]) & set(c.flags)
    assert "moe_layer_freq" in build_configs(parse(MOE)).flags


@pytest.mark.parametrize("extra, world, message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
     "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 "
     "must divide the world size 4 (Megatron's expert grid; "),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "3"], 4,
     "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 x --pipeline-model-parallel-size 1 = 3"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 4, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], 4, "--moe-expert-capacity-factor must be > 0, got 0.0 (Megatron reads a negative value as dropless"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "-1"], 4, "--moe-expert-capacity-factor must be > 0, got -1.0 (Megatron reads a negative value as dropless"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 4,
     "--moe-token-dispatcher-type flex: the flex dispatcher runs DeepEP/HybridEP/NCCL EP kernels, not available "
     "here; use alltoall"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "a2a"], 4,
     "--moe-token-dispatcher-type 'a2a' is not a choice: alltoall, allgather"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], 4,
     "--moe-router-load-balancing-type sinkhorn: Sinkhorn routing (S-BASE) is not available"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "global_aux_loss"], 4,
     "--moe-router-load-balancing-type global_aux_loss: the aux loss over the global batch is not available"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "quantile_balancing"], 4,
     "--moe-router-load-balancing-type quantile_balancing: quantile balancing is not available"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "balanced"], 4,
     "--moe-router-load-balancing-type 'balanced' is not a choice: aux_loss, seq_aux_loss, none"),
    (["--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus"], 4,
     "--moe-router-score-function sqrtsoftplus: sqrt(softplus) router scores are not available"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], 4, "--moe-layer-freq [1, 0, 1]: needs 4 entries"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*4+foo"], 4, "--moe-layer-freq '[1]*4+foo': only lists"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "0.1", "0.2"], 4,
     "--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type (1), got 2"),
    (["--expert-model-parallel-size", "2"], 4, "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "0"], 4, "--expert-model-parallel-size must be >= 1"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 4,
     "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel in training"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "30", "--expert-tensor-parallel-size", "4"], 4,
     "--moe-ffn-hidden-size 30 is not divisible by --expert-tensor-parallel-size 4"),
    (["--num-experts", "4", "--moe-shared-expert-gate"], 4,
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, extra, world, message):
    assert refused(capsys, BASE + extra, world_size=world).startswith(message)


def test_moe_needs_disable_bias_linear(capsys):
    argv = [a for a in MOE if a != "--disable-bias-linear"]
    assert refused(capsys, argv).startswith("--num-experts needs --disable-bias-linear")


def test_tp_without_sp_is_refused_in_training_only(capsys):
    argv = MOE + ["--tensor-model-parallel-size", "2"]
    assert parse(argv, training=False).num_experts == 4  # e.g. the planner's parse
    assert "needs --sequence-parallel" in refused(capsys, argv)


def test_values_megazero_lacks_are_ignored_for_a_dense_model_as_in_megatron(capsys):
    assert parse(BASE + ["--moe-token-dispatcher-type", "flex"]).num_experts is None
    assert "'a2a' is not a choice" in refused(capsys, BASE + ["--moe-token-dispatcher-type", "a2a"])


def test_every_problem_listed_together(capsys):
    problems = refused(capsys, BASE + ["--num-experts", "6", "--expert-model-parallel-size", "4",
                                       "--moe-router-topk", "7", "--tensor-model-parallel-size", "2"]).split("; ")
    assert any(p.startswith("--num-experts 6 is not divisible") for p in problems), problems
    assert any(p.startswith("--moe-router-topk 7 must be between") for p in problems), problems
    assert any("needs --sequence-parallel" in p for p in problems), problems


def test_flag_table_classes_and_reasons(capsys):
    rows = {f.name: f for f in megatron_flags()}
    moe = [f for f in megatron_flags() if "moe" in f.dest or "expert" in f.dest]
    assert not [f.name for f in moe if "mixture-of-experts is not available" in f.note]
    honoured = ("--num-experts", "--moe-layer-freq", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
                "--moe-grouped-gemm", "--expert-model-parallel-size", "--expert-tensor-parallel-size")
    assert all(rows[n].cls == 1 for n in honoured)
    assert rows["--moe-permute-fusion"].cls == 2 and rows["--overlap-moe-expert-parallel-comm"].cls == 2
    args = parse(MOE + ["--moe-permute-fusion", "--moe-layer-recompute", "--moe-shared-expert-overlap"])
    assert set(args.megatron_no_effect) == {"--moe-permute-fusion", "--moe-layer-recompute", "--moe-shared-expert-overlap"}
    message = refused(capsys, MOE + ["--moe-input-jitter-eps", "0.01", "--moe-use-upcycling"])
    assert "--moe-input-jitter-eps 0.01 (multiplicative input jitter" in message and "--moe-use-upcycling (dense-to-MoE" in message


def mixtral_command_line(tmp_path, gpus=4) -> list[str]:
    """The flags examples/megatron/train_mixtral_8x7b_distributed.sh gives pretrain_gpt.py (its
    interpreter replaced by a stub that prints them)."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "examples" / "megatron" / "train_mixtral_8x7b_distributed.sh"),
                          str(tmp_path / "ck")], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE=str(gpus)))
    assert out.returncode == 0, out.stderr
    argv = out.stdout.splitlines()
    script = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))  # the script by its full path
    return argv[script + 1:]


@pytest.mark.filterwarnings("ignore:--sequence-parallel needs")
@pytest.mark.parametrize("gpus", [4, 8])
def test_mixtral_script_validates_at_ep2(tmp_path, gpus):
    argv = mixtral_command_line(tmp_path, gpus)
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "2" and "--moe-grouped-gemm" in argv
    args = parse(argv, world_size=gpus)
    assert (args.num_experts, args.moe_router_topk, args.moe_token_dispatcher_type) == (8, 2, "alltoall")
    c = build_configs(args)
    assert (c.parallel.ep, c.parallel.etp, c.parallel.pp, c.parallel.dp) == (2, 1, 2, gpus // 2)
    assert c.model.moe.num_experts == 8 and c.model.moe.coeff("aux_loss") == 0.01 and not c.model.add_bias_linear
    assert set(args.megatron_no_effect) == {"--use-mcore-models", "--no-masked-softmax-fusion"}
