#!/usr/bin/env python
"""Run every CPU benchmark in sequence, echo its output, and print a summary with Markdown tables.

    make bench                                   # = .venv/bin/python bench/run_all.py
    .venv/bin/python bench/run_all.py [--only zero pipeline] [--quick] [--markdown out.md]

Benches (each a separate process, ``PYTHONPATH`` = the repository root, run from there):

* ``tensor_parallel`` -- megazero TP+SP vs DTensor TP+SP, TP = 2 and 4
* ``pipeline``        -- megazero 1F1B / interleaved vs ``torch.distributed.pipelining``
* ``zero``            -- ZeRO 0-2 vs DDP, ZeRO-3 vs FSDP2, ZeRO-3 vs ZeRO-2, Φ multiples, state bytes
* ``moe``             -- MoE dispatchers (alltoall vs allgather, EP 2 and 4: time, rows sent vs the
  planner's formula) and the MoE layer vs a plain per-expert PyTorch loop
* ``preprocess``      -- tokenizing the bundled corpus, sample/blending index build
* ``generate``        -- megazero generation vs ``transformers`` (only if ``bench/generate.py`` exists)
* ``gpu_mfu``         -- ``bench/gpu_mfu.py --tiny`` on CPU (a smoke run; its real figure needs a GPU)
* ``context_parallel`` -- CP 1/2/4 (ring and Ulysses) at seq 8192: per-rank step peak, step time, traffic vs formula

The machine (cores, CPU model, load average before and after each bench), the date and the
commit are printed with the results, since the figures move with the load of a shared box.
Budget: under 15 minutes on 2 cores (``--quick`` halves the step counts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benches(quick: bool) -> list[tuple[str, list[str]]]:
    s = (lambda full, fast: str(fast if quick else full))  # noqa: E731
    out = [("tensor_parallel", ["bench/tensor_parallel.py", "--steps", s(10, 5)]),
           ("pipeline", ["bench/pipeline.py", "--steps", s(6, 3), "--warmup", s(2, 1)]),
           ("zero", ["bench/zero.py", "--steps", s(8, 4)]),
           ("zero", ["bench/zero.py", "--stage", "2", "3", "--tokens", "512", "--steps", s(8, 4)]),
           ("moe", ["bench/moe.py", "--reps", s(6, 3)]),
           ("preprocess", ["bench/preprocess.py"] + (["--scale", "2"] if quick else []))]
    if os.path.exists(os.path.join(ROOT, "bench", "generate.py")):
        out.append(("generate", ["bench/generate.py"]))
    out.append(("gpu_mfu", ["bench/gpu_mfu.py", "--tiny"]))
    out.append(("context_parallel", ["bench/context_parallel.py", "--seq", s(8192, 4096), "--iters", s(3, 2)]))
    return out


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    import torch
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "nproc": os.cpu_count(),
            "cpu": model, "load": load(), "python": platform.python_version(), "torch": torch.__version__,
            "commit": commit}


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run(name: str, cmd: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full = [sys.executable] + cmd
    print(f"\n===== {name}: {' '.join(['python'] + cmd)}   (load {load()})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
    rc = proc.wait()
    dt = time.perf_counter() - t0
    print(f"===== {name}: exit {rc}, {dt:.1f} s, load after {load()}", flush=True)
    return {"name": name, "command": "PYTHONPATH=. .venv/bin/python " + " ".join(cmd), "rc": rc,
            "seconds": round(dt, 1), "load_after": load(), "lines": lines}


def _json_lines(lines):
    out = []
    for line in lines:
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def table_tensor_parallel(lines):
    rows = [l.split() for l in lines if re.match(r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\S+$", l)]
    return _table(["TP", "megazero ms", "DTensor ms", "megazero/DTensor", "max abs diff"], rows)


def table_pipeline(lines):
    out, mode = [], None
    rows = []
    for l in lines:
        if l.startswith("-- "):
            mode = "matmul" if "matmul" in l else "sleep"
        m = re.match(r"^(.+?)\s+step\s+([\d.]+) ms\s+bubble ([\d.]+) \(theory ([\d.]+)(?:, trace bubble ([\d.]+))?", l)
        if m:
            rows.append([mode, m[1].strip(), m[2], m[3] + (f" (trace {m[5]})" if m[5] else ""), m[4]])
        m = re.match(r"^step-time ratio megazero/torch VP=(\d): ([\d.]+)", l)
        if m:
            rows.append([mode, f"ratio megazero/torch VP={m[1]}", m[2], "", ""])
        m = re.match(r"^bubble cut by interleaving \((\w+)\): ([\d.]+)x", l)
        if m:
            rows.append([mode, f"bubble cut by interleaving, {m[1]}", "", m[2] + "x", "2.00x"])
    out += _table(["compute", "schedule", "step ms (median)", "bubble (measured)", "bubble (theory)"], rows)
    return out


def table_zero(lines):
    js = _json_lines(lines)
    times = {j["system"]: j["median_s"] for j in js if j.get("kind") == "time"}
    out = ["Step time (median, slowest rank):", ""]
    out += _table(list(times), [[f"{v:.3f} s" for v in times.values()]])
    out += ["", "Ratios:", ""]
    out += _table(["ratio", "value", "target", "met"],
                  [[j["what"], j["ratio"], j["target"], j["met"]] for j in js if j.get("kind") == "ratio"])
    out += ["", "Communication per step per rank (in Φ) and model-state bytes per rank vs the ZeRO formulas:", ""]
    vol = {j["stage"]: j for j in js if j.get("kind") == "volume"}
    st = {j["stage"]: j for j in js if j.get("kind") == "state"}
    rows = []
    for stage in sorted(set(vol) | set(st)):
        v, s = vol.get(stage, {}), st.get(stage, {})
        rows.append([stage, v.get("phi", ""), v.get("dp_logical_multiple", ""), v.get("dp_primitive_multiple", ""),
                     f"{s['bytes'] / 1e6:.2f} MB" if s else "", f"{s['formula'] / 1e6:.2f} MB" if s else "",
                     s.get("ratio", "")])
    out += _table(["stage", "Φ", "logical multiple", "primitive multiple (gloo)", "state bytes", "formula",
                   "measured/formula"], rows)
    return out


def table_moe(lines):
    js = _json_lines(lines)
    out = _table(["EP", "dispatcher", "ms (median)", "rows sent / rank", "formula", "bound", "sent/formula",
                  "MB / layer fwd+bwd", "max abs diff vs other"],
                 [[j["ep"], j["dispatcher"], j["median_ms"], j["sent_rows"], j["formula_rows"], j["bound_rows"],
                   f"{j['sent_rows'] / j['formula_rows']:.3f}", j["mb_per_layer_fwd_bwd"],
                   f"{j['max_diff_vs_other']:.1e}"]
                  for j in js if j.get("kind") == "dispatch"])
    out += [""] + _table(["tokens", "MoELayer ms", "per-expert loop ms", "MoELayer/loop", "max abs diff out",
                          "max abs diff grad"],
                         [[j["tokens"], j["megazero_ms"], j["loop_ms"], j["ratio"], f"{j['max_diff_out']:.1e}",
                           f"{j['max_diff_grad']:.1e}"] for j in js if j.get("kind") == "layer"])
    return out


def table_preprocess(lines):
    js = [j for j in _json_lines(lines) if "rows" in j]
    if not js:
        return ["(no result)"]
    rows = [[r["name"], f"{r['seconds']:.2f}", r["MB_per_s"] if r["MB_per_s"] else ""] for r in js[-1]["rows"]]
    return [f"Corpus {js[-1]['input']}: {js[-1]['documents']} documents, {js[-1]['input_MB']} MB JSON", ""] + \
        _table(["step", "seconds", "MB/s"], rows)


def table_generate(lines):
    head = [l.strip() for l in lines if l.startswith("greedy generation")]
    return head[-1:] + [""] + [l for l in lines if l.startswith("|")]


def table_gpu_mfu(lines):
    js = [j for j in _json_lines(lines) if j.get("bench") == "gpu_mfu"]
    if not js:
        return ["(no result)"]
    j = js[-1]
    keys = ("device", "params", "dtype", "zero_stage", "seq_length", "micro_batch_size", "num_micro_batches",
            "median_step_s", "tokens_per_s", "achieved_tflops", "mfu")
    return _table(list(keys), [[j[k] for k in keys]])


def table_context_parallel(lines):
    return [l for l in lines if l.startswith("|")] + [""] + [l for l in lines if l.startswith("target ")]


def table_generic(lines):
    js = _json_lines(lines)
    if js:
        return ["```", *(json.dumps(j) for j in js[-6:]), "```"]
    return ["```", *lines[-15:], "```"]


TABLES = {"tensor_parallel": table_tensor_parallel, "pipeline": table_pipeline, "zero": table_zero,
          "moe": table_moe, "preprocess": table_preprocess, "generate": table_generate, "gpu_mfu": table_gpu_mfu,
          "context_parallel": table_context_parallel}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=None, help="bench names to run (default: all)")
    p.add_argument("--quick", action="store_true", help="about half the steps (noisier)")
    p.add_argument("--markdown", default=None, help="also write the summary tables to this file")
    a = p.parse_args(argv)
    info = machine()
    print(f"machine: {info['nproc']} CPUs, {info['cpu']}; load average {info['load']}; {info['date']}; "
          f"python {info['python']}, torch {info['torch']}, commit {info['commit']}", flush=True)
    t0 = time.perf_counter()
    results = []
    for name, cmd in benches(a.quick):
        if a.only and name not in a.only:
            continue
        try:
            results.append(run(name, cmd))
        except Exception as e:  # keep going: one bench failing should not hide the others
            results.append({"name": name, "command": " ".join(cmd), "rc": -1, "seconds": 0, "load_after": load(),
                            "lines": [f"could not run: {e}"]})
    total = time.perf_counter() - t0
    md = [f"Machine: {info['nproc']} CPUs ({info['cpu']}), load average at start {info['load']}; "
          f"{info['date']}; torch {info['torch']}; commit {info['commit']}; total {total / 60:.1f} min.", ""]
    for r in results:
        md += [f"### {r['name']}", "", f"`{r['command']}` — exit {r['rc']}, {r['seconds']} s, "
               f"load average after {r['load_after']}", ""]
        md += (TABLES.get(r["name"], table_generic)(r["lines"]) if r["rc"] == 0 else
               ["```", *r["lines"][-15:], "```"])
        md.append("")
    print("\n" + "=" * 30 + " summary " + "=" * 30)
    print("\n".join(md), flush=True)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
    failed = [r["name"] for r in results if r["rc"] != 0]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
