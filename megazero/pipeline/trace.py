"""Schedule trace: each rank's forward / backward / p2p-wait intervals of one step, as a
Chrome-trace JSON (open in https://ui.perfetto.dev or chrome://tracing), and a bubble report.
The zero-bubble schedules' deferred weight gradients (plan action ``W``) appear as
``weight-grad`` events in the slots 1F1B leaves idle.

Usage (what the training loop does for ``--pipeline-trace FILE``)::

    trace = ScheduleTrace()                          # on the traced step (the loop's third)
    losses = runner.run(..., trace=trace)            # a PipelineRunner
    write_pipeline_trace(path, trace)                # collective over the world

Timestamps are relative to each rank's exit from a pipeline-group barrier at the start of the
step (so ranks on different hosts line up to within the barrier's skew).  Measured bubble of
a rank: ``(T - busy) / busy``, with ``T`` the pipeline's step time (latest end over its ranks)
and ``busy`` the rank's summed forward, backward and weight-gradient time -- the quantity whose theory is
``(PP - 1) / (VP M)`` (bubble time over ideal time; the wait and p2p time counts as bubble).
"""

from __future__ import annotations

import json
import statistics
import time

import torch.distributed as dist

from .plan import theoretical_bubble

# plan action kind -> trace category; "weight-grad": the deferred W of a zero-bubble schedule
_CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}
_COMPUTE = tuple(_CATEGORY.values())


class ScheduleTrace:
    """Events of one rank for one step: ``(name, category, start_s, end_s, args)``."""

    def __init__(self):
        self.events: list[tuple] = []
        self.meta: dict = {}
        self.t0 = 0.0

    def begin(self, topo, schedule: str, m: int, vp: int) -> None:
        self.t0 = time.perf_counter()
        self.events.clear()
        self.meta = {"rank": topo.rank, "pp_rank": topo.pp_rank, "tp_rank": topo.tp_rank, "dp_rank": topo.dp_rank,
                     "pp": topo.pp, "vp": vp, "m": m, "schedule": schedule}

    def record(self, action, start: float, end: float) -> None:
        if action.kind == "COMM":
            name, cat, args = "p2p", "wait", {"ops": [str(o) for o in action.ops]}
        else:
            cat = _CATEGORY[action.kind]
            name, args = f"{cat} m{action.mb} c{action.chunk}", {"mb": action.mb, "chunk": action.chunk}
        self.events.append((name, cat, start - self.t0, end - self.t0, args))

    def busy(self) -> float:
        return sum(e - s for _, cat, s, e, _ in self.events if cat in _COMPUTE)

    def end(self) -> float:
        return max((e for _, _, _, e, _ in self.events), default=0.0)


def bubble_report(traces: list[dict]) -> dict:
    """From gathered ``{"meta", "events"}`` of the ranks of one or more pipelines: per-rank and
    mean measured bubble, theory, and step time (seconds)."""
    by_pipe: dict = {}
    for t in traces:
        key = (t["meta"]["tp_rank"], t["meta"]["dp_rank"])
        by_pipe.setdefault(key, []).append(t)
    per_rank, step_times = {}, []
    for ranks in by_pipe.values():
        step = max(max((e[3] for e in t["events"]), default=0.0) for t in ranks)
        step_times.append(step)
        for t in ranks:
            busy = sum(e[3] - e[2] for e in t["events"] if e[1] in _COMPUTE)
            per_rank[t["meta"]["rank"]] = (step - busy) / busy if busy > 0 else float("nan")
    meta = traces[0]["meta"]
    return {"schedule": meta["schedule"], "pp": meta["pp"], "vp": meta["vp"], "m": meta["m"],
            "step_time_s": max(step_times), "bubble_per_rank": per_rank,
            "bubble_measured": statistics.mean(per_rank.values()),
            "bubble_theory": theoretical_bubble(meta["pp"], meta["vp"], meta["m"], meta["schedule"])}


def format_bubble_report(rep: dict) -> str:
    ranks = " ".join(f"r{r}={b:.3f}" for r, b in sorted(rep["bubble_per_rank"].items()))
    return (f"pipeline {rep['schedule']} PP={rep['pp']} VP={rep['vp']} M={rep['m']}: step {rep['step_time_s'] * 1e3:.1f} ms, "
            f"bubble measured {rep['bubble_measured']:.3f} vs theory {_theory_label(rep['schedule'])} = "
            f"{rep['bubble_theory']:.3f} ({ranks})")


def _theory_label(schedule: str) -> str:
    classic = schedule in ("no-pipelining", "1f1b", "interleaved-1f1b")
    return "(PP-1)/(VP*M)" if classic else "simulated with F=B=W"


def chrome_trace(traces: list[dict]) -> dict:
    """Chrome-trace JSON object: one process per global rank, complete ("X") events in us."""
    out = []
    for t in traces:
        meta = t["meta"]
        pid = meta["rank"]
        label = f"rank {pid} (pp {meta['pp_rank']} tp {meta['tp_rank']} dp {meta['dp_rank']})"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, cat, s, e, args in t["events"]:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0,
                        "ts": round(s * 1e6, 3), "dur": round((e - s) * 1e6, 3), "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def gather_traces(trace: ScheduleTrace, group=None, dst: int = 0) -> list[dict] | None:
    """Collective: every rank of ``group`` (default: world) sends its trace to global rank ``dst``."""
    mine = {"meta": trace.meta, "events": trace.events}
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    everything = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(mine, everything, dst=dst, group=group)
    return everything


def write_pipeline_trace(path: str, trace: ScheduleTrace, print_fn=print) -> dict | None:
    """Collective over the world: gather every rank's trace to rank 0, which writes the Chrome
    trace to ``path`` and prints and returns the bubble report (other ranks return None)."""
    traces = gather_traces(trace)
    if traces is None:
        return None
    with open(path, "w") as f:
        json.dump(chrome_trace(traces), f)
    rep = bubble_report(traces)
    if print_fn is not None:
        print_fn(format_bubble_report(rep) + f"; trace written to {path}")
    return rep
