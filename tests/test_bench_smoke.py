"""Smoke tests of the benchmark scripts: bench/gpu_mfu.py --tiny on CPU, and run_all's table parsers."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("extra", [[], ["--arch", "gpt2", "--zero-stage", "0", "--recompute", "selective",
                                        "--peak-tflops", "1"]])
def test_gpu_mfu_tiny_runs_on_cpu(extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--tiny", "--steps", "2", "--warmup", "1",
                        "--threads", "1", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["tiny"] and out["steps"] == 2
    assert out["tokens_per_step"] == 2 * 2 * 64 and out["tokens_per_s"] > 0
    assert out["median_step_s"] > 0 and out["model_tflop_per_step"] > 0
    assert all(math.isfinite(x) for x in out["loss_first_last"]) and out["skipped"] == 0
    assert "--bf16" in out["megatron_flags"]
    if "--peak-tflops" in extra:
        assert out["mfu"] is not None and 0 < out["mfu"] < 1
        assert out["zero_stage"] == 0 and out["recompute"] == "selective"
    else:
        assert out["mfu"] is None  # no peak for a CPU


def test_peak_table_picks_the_specific_name():
    mfu = _load("gpu_mfu")
    assert mfu.peak_tflops("NVIDIA H200") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mfu.peak_tflops("NVIDIA A10G") == 70.0
    assert mfu.peak_tflops("NVIDIA L4") == 121.0
    assert mfu.peak_tflops("Tesla V100-SXM2-16GB") is None


def test_flops_formula_matches_6n_plus_attention_for_the_default_model():
    """The default model's FLOPs per token ~ 6 N (+ attention), so MFU is on the usual scale."""
    from megazero.arguments import parse_args
    from megazero.training.build import build_configs
    from megazero.training.logger import model_flops_per_iteration
    mfu = _load("gpu_mfu")

    class A:
        arch, tiny, micro_batch_size, num_micro_batches, warmup, steps = "llama", False, 1, 1, 0, 1
        zero_stage, dtype, recompute = 1, "bf16", None
    args = parse_args(mfu.megatron_argv(A), world_size=1)
    config = build_configs(args).model
    per_token = model_flops_per_iteration(config, args.global_batch_size) / args.seq_length
    h, s, L, f, V = 2048, 2048, 24, config.ffn_hidden_size, config.padded_vocab(1)
    n = L * (4 * h * h + 3 * h * f) + 2 * V * h  # untied: input + output matrices
    attention = 6 * 2 * L * s * h  # QK^T and AV, fwd + bwd, causal counted in full
    expected = 6 * (n - V * h) + attention  # the input embedding is a lookup
    assert per_token == pytest.approx(expected, rel=1e-6)
    assert 1.25e9 < n < 1.45e9


def test_run_all_tables_parse_bench_output():
    run_all = _load("run_all")
    tp = run_all.table_tensor_parallel(["header", " TP  megazero ms  DTensor ms  ratio  max |diff|",
                                        "  2        104.5       140.4   0.74    0.00e+00"])
    assert tp[-1] == "| 2 | 104.5 | 140.4 | 0.74 | 0.00e+00 |"
    pp = run_all.table_pipeline(["-- real matmul compute",
                                 "megazero 1F1B                    step   1424.0 ms  bubble 0.820 (theory 0.375)",
                                 "step-time ratio megazero/torch VP=1: 0.850 (target <= 1.0)",
                                 "bubble cut by interleaving (torch): 1.30x (theory 2.00x, target >= 1.6x)"])
    assert "| matmul | megazero 1F1B | 1424.0 | 0.820 | 0.375 |" in pp
    assert any("ratio megazero/torch VP=1 | 0.850" in row for row in pp)
    zero = run_all.table_zero([json.dumps(x) for x in [
        {"kind": "volume", "stage": 1, "phi": 100, "dp_logical_multiple": 2.0, "dp_primitive_multiple": 3.0},
        {"kind": "state", "stage": 1, "bytes": 2_990_000, "formula": 2_990_000, "ratio": 1.0},
        {"kind": "time", "system": "zero-1", "median_s": 0.2}, {"kind": "time", "system": "ddp", "median_s": 0.3},
        {"kind": "ratio", "what": "zero-1/ddp", "ratio": 0.667, "target": 1.05, "met": True}]])
    assert "| zero-1/ddp | 0.667 | 1.05 | True |" in zero
    assert "| 1 | 100 | 2.0 | 3.0 | 2.99 MB | 2.99 MB | 1.0 |" in zero


def test_loop_bench_runs_megazero_and_both_peers(capsys):
    """bench/loop.py at tiny sizes: megazero's logged iteration times (ZeRO 0 and 3, one log line
    per iteration), the bare loop on megazero's model and the independent plain GPT
    (bench/ddp_peer.py) under DDP / FSDP2, each stage in its own ranks and at ZeRO-3 megazero and
    the peers apart (one launch per repetition); ratios per repetition."""
    loop = _load("loop")
    loop.main(["--ranks", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
               "--micro-batch", "2", "--global-batch", "4", "--vocab", "64", "--iters", "2", "--reps", "2",
               "--warmup", "0", "--stage", "0", "3", "--log-interval", "1"])
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    rows = {(j["stage"], j["log_interval"]): j for j in lines if j["kind"] == "loop"}
    assert sorted(rows) == [(0, 1), (3, 1)]
    assert rows[0, 1]["peer"] == "ddp" and rows[3, 1]["peer"] == "fsdp2"
    for row in rows.values():
        for system in ("megazero", "peer", "independent"):
            assert row[f"{system}_ms"] > 0 and len(row[f"{system}_runs_ms"]) == 2
        assert abs(row["ratio"] - row["megazero_ms"] / row["peer_ms"]) < 0.01 * row["ratio"]
        assert len(row["paired_ratios"]) == len(row["independent_paired_ratios"]) == 2
        assert isinstance(row["agree"], bool) and row["met"] == (row["independent_paired_ratio"] <= row["target"])
    assert rows[0, 1]["ranks"] == "shared" and rows[3, 1]["ranks"] == "separate"
    assert lines[0]["kind"] == "config" and lines[-1]["kind"] == "load"
    with pytest.raises(SystemExit):  # megazero's figure is its log lines: whole intervals only
        loop.main(["--iters", "3", "--log-interval", "2"])


def _bench(script, *flags, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, f"bench/{script}", *flags], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_save_timing_runs_both_modes():
    """bench/save_timing.py at a tiny size: saves at 2 and 4 of 5 iterations, so iterations 3 and
    5 are the after-save ones in each mode."""
    out = json.loads(_bench("save_timing.py", "--stage", "1", "--dp", "2", "--layers", "1", "--hidden", "64",
                            "--heads", "4", "--rounds", "1", "--iters", "5", "--interval", "2"))
    for mode in ("sync", "async"):
        assert len(out[mode]["after_save_ms"]) == 2 and out[mode]["ratio"] > 0
        assert len(out[mode]["save_s"]) == 3, "saves at 2 and 4, and at the end"
    assert out["ranks"] == 2


def test_memory_bench_stage2_bound_counts_its_bucket():
    """bench/memory.py at a tiny size, stage 2: every phase reported, and the bound's transient is
    the largest bucket's full fp32 gradient when that is larger than the largest weight."""
    out = _bench("memory.py", "--stages", "2", "--dp", "2", "--layers", "1", "--hidden", "64", "--heads", "4",
                 "--dtype", "fp32", "--reduce-bucket-size", "100000000")
    row = json.loads(next(line for line in out.splitlines() if line.startswith('{"stage"')))
    assert set(row["peaks"]) == {"build", "step", "save", "load"}
    assert row["bucket"] == row["transient"] > 4 * 50304 * 64, "one bucket: the whole model's fp32 gradient"
    assert 16 * row["phi"] <= row["written"] < 1.05 * 16 * row["phi"], "fp32: one copy of weights + master + moments"


def test_moe_bench_dispatchers_and_layer_vs_loop():
    """bench/moe.py at a tiny size: both dispatchers at EP 2 give the same output, the allgather
    sends exactly (EP-1) T rows, the alltoall at most T k (its formula's expectation T k (EP-1)/EP);
    the MoE layer equals the plain per-expert loop, output and input gradient."""
    out = _bench("moe.py", "--ep", "2", "--seq", "16", "--batch", "1", "--hidden", "32", "--ffn", "64",
                 "--experts", "4", "--reps", "2", "--warmup", "0")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    dispatch = {r["dispatcher"]: r for r in rows if r["kind"] == "dispatch"}
    assert sorted(dispatch) == ["allgather", "alltoall"] and all(r["ep"] == 2 for r in dispatch.values())
    assert dispatch["allgather"]["sent_rows"] == dispatch["allgather"]["formula_rows"] == 16
    assert 0 < dispatch["alltoall"]["sent_rows"] <= dispatch["alltoall"]["bound_rows"] == 16 * 2
    assert dispatch["alltoall"]["formula_rows"] == 16 * 2 / 2
    assert all(r["max_diff_vs_other"] < 1e-5 and r["median_ms"] > 0 for r in dispatch.values())
    layer = next(r for r in rows if r["kind"] == "layer")
    assert layer["max_diff_out"] < 1e-5 and layer["max_diff_grad"] < 1e-5 and layer["ratio"] > 0
    run_all = _load("run_all")
    table = run_all.table_moe(out.splitlines())
    assert table[0].startswith("| EP | dispatcher |") and any("| 2 | allgather |" in row for row in table)


def test_context_parallel_bench_counts_the_formula_bytes():
    """bench/context_parallel.py at a tiny size, CP 1 and 2, both comm types: the bytes each rank
    sends equal the formulas exactly, every row has its times, and run_all's parser
    keeps the Markdown table and the target lines."""
    out = _bench("context_parallel.py", "--seq", "64", "--hidden", "32", "--vocab", "64", "--cp", "1", "2",
                 "--iters", "1")
    rows = {(j["cp"], j["comm"]): j for j in map(json.loads, (l for l in out.splitlines() if l.startswith("{")))}
    assert sorted(rows) == [(1, "sdpa"), (2, "a2a"), (2, "p2p")]
    ring, ulysses = rows[2, "p2p"], rows[2, "a2a"]
    kv = 4 * 32 * 8 * 4  # one rank's K: G 4 x s/CP 32 x d 8, fp32
    # 2 layers x (forward (K, V) once + backward (K, V) once + (dK, dV) twice): CP 2
    assert ring["sent"]["ring"] == ring["formula"]["ring"] == 2 * (2 * kv + 2 * kv + 2 * 2 * kv)
    assert ring["sent"]["a2a"] == 0
    assert ulysses["sent"]["a2a"] == ulysses["formula"]["a2a"] > 0 and ulysses["sent"]["ring"] == 0
    assert all(r["wall_s"] > 0 and r["cpu_s"] > 0 and "step_peak" in r for r in rows.values())
    summary = _load("run_all").table_context_parallel(out.splitlines())
    assert summary[0].startswith("| seq | CP |") and sum(l.startswith("| 64 |") for l in summary) == 3
    assert summary[-1].startswith("target seq 64 CP 2 a2a")
