"""Markdown and JSON of ``bench/gpu_check.py``'s report, and its verdict.

``write(report, out)`` writes ``out/gpu_check.json`` (the report as is, plus ``verdict``) and
``out/gpu_check.md`` (one section per phase) and returns True when every check passed: no phase
failed, every correctness run within its tolerance, device and CPU greedy tokens equal. The speed
targets of issue 17 (MFU >= 0.45 for the 1.34B model on one H200, megazero tokens/s >= 1.0x the
plain-PyTorch peer's) and the memory comparison are reported in the verdict but do not fail it:
they are measurements, not correctness. Memory ratios are measured / planned bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

MFU_TARGET, PEER_TARGET = 0.45, 1.0
GIB = 2**30


def verdict(report: dict) -> dict:
    """{"pass": bool, "failed": [...], "targets": {...}} from a report."""
    failed = [name for name, v in report.items() if isinstance(v, dict) and "error" in v]
    for r in report.get("correctness", {}).get("runs", []):
        if not r["pass"]:
            failed.append(f"correctness {_label(r)} ZeRO {r['zero']}: max rel diff {r['max_rel_diff']:.2e}")
    if report.get("generation", {}).get("pass") is False:
        failed.append("generation: device tokens differ from the CPU's")
    if "correctness" in report and "generation" not in report:
        failed.append("generation: not run")
    targets = {}
    speed = report.get("speed", {})
    if "megazero" in speed and not report.get("dry_run"):
        best = max(speed["megazero"], key=lambda r: r["tokens_per_s"])
        targets = {"mfu": best["mfu"], "mfu_met": (best["mfu"] or 0) >= MFU_TARGET,
                   "vs_peer": best["vs_peer"], "vs_peer_met": best["vs_peer"] >= PEER_TARGET}
    return {"pass": not failed, "failed": failed, "targets": targets}


def _label(run: dict) -> str:
    """The dtype, with the model variant when it is not the dense GPT (e.g. "fp32 moe")."""
    return run["dtype"] + ("" if run.get("variant", "dense") == "dense" else f" {run['variant']}")


def _fmt(x, spec=".4g") -> str:
    return "–" if x is None else format(x, spec)


def _environment(env: dict) -> list[str]:
    keys = ["date", "gpu", "gpu_memory_GiB", "compute_capability", "multiprocessors", "driver", "cuda",
            "nccl", "cudnn", "torch", "python", "host_cpus", "note"]
    return ["## Environment", "", "| | |", "|---|---|"] + [f"| {k} | {env[k]} |" for k in keys if k in env]


def _correctness(corr: dict, gen: dict) -> list[str]:
    lines = ["## Correctness (device vs CPU, pretrain_gpt.py, world size 1)", "",
             "| dtype | ZeRO | iters | loss 1 (device / CPU) | last loss (device / CPU) | max rel diff | tolerance | |",
             "|---|---|---|---|---|---|---|---|"]
    for r in corr.get("runs", []):
        d, c = r["device_losses"], r["cpu_losses"]
        lines.append(f"| {_label(r)} | {r['zero']} | {r['iters']} | {d[0]:.6f} / {c[0]:.6f} | {d[-1]:.6f} / "
                     f"{c[-1]:.6f} | {r['max_rel_diff']:.2e} | {r['tolerance']:g} | {'pass' if r['pass'] else 'FAIL'} |")
    if gen and "pass" in gen:
        lines += ["", f"Greedy generation, TP 1, fp32, from the CPU fp32 ZeRO-0 checkpoint: "
                      f"{'equal' if gen['pass'] else 'DIFFERENT'} tokens on device and CPU.", ""]
        for p, d, c in zip(gen.get("prompts", []), gen.get("device_tokens", []), gen.get("cpu_tokens", [])):
            lines.append(f"* `{p}` -> device `{d}`" + ("" if d == c else f", CPU `{c}`"))
    return lines


def _speed(speed: dict) -> list[str]:
    lines = ["## Speed (bench/gpu_mfu.py vs bench/gpu_peer.py)", "",
             "| run | recompute | tokens/s | TFLOP/s | MFU | x peer | peak GiB | planner GiB | measured / planned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in speed.get("megazero", []):
        plan = r["planner"]["total_bytes"] / GIB
        peak = r["max_memory_allocated_GiB"]
        lines.append(f"| megazero ({r['params'] / 1e9:.3g}B, {r['dtype']}, ZeRO {r['zero_stage']}) | "
                     f"{r['recompute'] or 'none'} | {r['tokens_per_s']:,.0f} | {_fmt(r['achieved_tflops'])} | "
                     f"{_fmt(r['mfu'], '.3f')} | {r['vs_peer']:.3f} | {_fmt(peak)} | {plan:.4g} | "
                     f"{_fmt(peak / plan if peak is not None else None, '.3f')} |")
    peer = speed.get("peer")
    if peer:
        lines.append(f"| plain PyTorch peer ({peer['params'] / 1e9:.3g}B: {peer['model']}) | none | "
                     f"{peer['tokens_per_s']:,.0f} | {_fmt(peer['achieved_tflops'])} | – | 1.000 | "
                     f"{_fmt(peer['max_memory_allocated_GiB'])} | – | – |")
    if speed.get("megazero"):
        r = speed["megazero"][0]
        lines += ["", f"Shape: seq {r['seq_length']}, micro-batch {r['micro_batch_size']} x {r['num_micro_batches']}"
                      f" = {r['tokens_per_step']} tokens/step, {r['steps']} timed steps after {r['warmup']}; "
                      f"SDPA backend {r['sdpa_backend']}; peak {r['peak_tflops']} TFLOP/s; "
                      f"device {r['device']}, torch {r['torch']}.", "", f"Flags: `{r['megatron_flags']}`"]
    return lines


def _memory(speed: dict) -> list[str]:
    lines = ["## Memory per phase (torch.cuda.max_memory_allocated) vs `python -m megazero.planner`", "",
             "| recompute | after build GiB | planner model states GiB | first step peak GiB | whole-run peak GiB |"
             " planner total GiB |", "|---|---|---|---|---|---|"]
    for r in speed.get("megazero", []):
        m, plan = r.get("memory_GiB") or {}, r["planner"]
        lines.append(f"| {r['recompute'] or 'none'} | {_fmt(m.get('after_build'))} | "
                     f"{plan['model_state_bytes'] / GIB:.4g} | {_fmt(m.get('peak_first_step'))} | "
                     f"{_fmt(m.get('peak'))} | {plan['total_bytes'] / GIB:.4g} |")
    lines += ["", "After build holds parameters and whatever optimizer state ZeroOptimizer makes eagerly; the "
                  "planner's model states count parameters, gradients and optimizer states (p + g + 12 bytes "
                  "per parameter at ZeRO 0/1, DP 1)."]
    return lines


def markdown(report: dict, v: dict) -> str:
    head = [f"# GPU check ({'DRY RUN on CPU' if report.get('dry_run') else 'device'}): "
            f"{'PASS' if v['pass'] else 'FAIL'}", "",
            f"`bench/gpu_check.py {' '.join(report.get('argv', []))}`, {report.get('total_seconds')} s in all "
            f"(per phase: {report.get('seconds')}).", ""]
    if v["failed"]:
        head += ["Failed:", ""] + [f"* {f}" for f in v["failed"]] + [""]
    if v["targets"]:
        t = v["targets"]
        head += [f"Targets: MFU {_fmt(t['mfu'], '.3f')} (>= {MFU_TARGET}: {'met' if t['mfu_met'] else 'NOT met'}); "
                 f"megazero / peer tokens/s {t['vs_peer']:.3f} (>= {PEER_TARGET}: "
                 f"{'met' if t['vs_peer_met'] else 'NOT met'}).", ""]
    body = []
    if isinstance(report.get("environment"), dict) and "error" not in report["environment"]:
        body += _environment(report["environment"]) + [""]
    if "runs" in report.get("correctness", {}):
        body += _correctness(report["correctness"], report.get("generation", {})) + [""]
    if "megazero" in report.get("speed", {}):
        body += _speed(report["speed"]) + [""] + _memory(report["speed"]) + [""]
    errors = [f"* **{k}**: ```{v['error'][-1500:]}```" for k, v in report.items() if isinstance(v, dict) and "error" in v]
    if errors:
        body += ["## Errors", ""] + errors + [""]
    return "\n".join(head + body)


def write(report: dict, out: Path) -> bool:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    v = verdict(report)
    report["verdict"] = v
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(report, v))
    return v["pass"]
