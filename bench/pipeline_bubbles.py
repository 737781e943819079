"""The zero-bubble schedules' bubble and memory in megazero's simulator, against the published
figures and against PyTorch's own plans (``bench/pipeline.py --bubble-table``).

For each schedule at PP = 4, 8 and M = 8, 16, 32, with a whole stage's F = B = W = 1 (a chunk of
a VP-chunk rank takes 1/VP of that; a backward that is not split costs B + W):

* ``bubble``: idle share of the step, ``sum(idle) / (PP x makespan)``, from
  ``megazero.pipeline.simulate`` on megazero's plans (``build_plan(..., schedule=NAME)``);
* ``published``: the paper's figure where one exists -- 1F1B ``(PP-1)/(M+PP-1)``; interleaved
  1F1B ``(PP-1)/(VP M+PP-1)``; ZB-H1 ``(PP-1)(F+B-2W)`` idle = ``(PP-1)/(3M+PP-1)``; ZBV the
  "1/6 of 1F1B's idle time" the issue quotes for PP = 4, M = 8 (idle ``(PP-1)/2``);
* ``torch``: the same simulator on ``torch.distributed.pipelining``'s own ``pipeline_order``
  (its schedule classes built from stand-in stages -- they need no process group -- the
  compute order taken as is, megazero's communication derived around it); not for 1F1B, whose
  single-stage ``Schedule1F1B.pipeline_order`` (torch 2.13) is only descriptive -- its last
  rank's micro-batches are off by one -- and not what ``Schedule1F1B.step`` runs;
* ``idle/1F1B``: the rank's idle time over 1F1B's (``(PP-1)(F+B+W)``);
* ``peak``: most activations held at once on a rank, in whole-stage units (chunk-activations /
  VP; a split backward's activation lives until its W) -- 1F1B's is PP.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megazero.pipeline import SCHEDULES, build_plan, placement, plan_from_steps, simulate

VP = {"1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}
TORCH = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def published(name: str, pp: int, m: int) -> float | None:
    vp = VP[name]
    if name in ("1f1b", "interleaved-1f1b"):
        return (pp - 1) / (vp * m + pp - 1)
    if name == "zb-h1":
        return (pp - 1) / (3 * m + pp - 1)
    if name == "zbv" and (pp, m) == (4, 8):
        return (pp - 1) / 2 / (3 * m + (pp - 1) / 2)
    return None


def torch_steps(name: str, pp: int, m: int) -> dict[int, list]:
    """torch's ``pipeline_order`` of ``name`` as megazero steps ``[(kind, mb, local chunk)]``
    (I -> B; an overlapped F/B pair -> one two-action step)."""
    from torch.distributed.pipelining import schedules as ts
    vp = VP[name]
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * vp, submod=torch.nn.Linear(1, 1))
              for _ in range(vp)]
    sched = getattr(ts, TORCH[name])(stages, m, loss_fn=lambda out, target: out)
    v = placement(name) == "v"
    out = {}
    for r, acts in sched.pipeline_order.items():
        steps = []
        for a in (a for a in acts if a is not None):
            step = []
            for x in (x for x in a.sub_actions or [a] if x.computation_type.value in "FBIW"):
                c = (0 if x.stage_index == r else 1) if v else x.stage_index // pp
                step.append(({"I": "B"}.get(x.computation_type.value, x.computation_type.value), x.microbatch_index, c))
            steps += [step] if step else []
        out[r] = steps
    return out


def row(name: str, pp: int, m: int, with_torch: bool = True) -> dict:
    vp = VP[name]
    t = 1.0 / vp

    def measure(plans):
        res = simulate(plans, t, t, t)
        return res["bubble"], max(res["idle"]), max(res["max_in_flight"]) / vp

    bubble, idle, peak = measure([build_plan(pp, vp, m, r, schedule=name) for r in range(pp)])
    out = {"schedule": name, "pp": pp, "m": m, "bubble": bubble, "idle": idle, "peak": peak,
           "published": published(name, pp, m), "torch": None}
    if with_torch and name == "1f1b":
        out["torch"] = "n/a"  # Schedule1F1B's pipeline_order is descriptive only (off by one on the last rank)
    elif with_torch:
        try:
            steps = torch_steps(name, pp, m)
        except Exception as e:  # noqa: BLE001 - a schedule torch refuses for this shape: say so
            out["torch"] = f"refused: {str(e).splitlines()[0][:60]}"
        else:
            plans = [plan_from_steps(pp, vp, r, steps.__getitem__, placement(name)) for r in range(pp)]
            out["torch"] = measure(plans)[0]
    return out


def table(pps=(4, 8), ms=(8, 16, 32), with_torch: bool = True) -> list[dict]:
    rows = []
    for pp in pps:
        for m in ms:
            base = None
            for name in SCHEDULES:
                if name == "dualpipev" and m < 2 * pp:
                    continue
                r = row(name, pp, m, with_torch)
                base = r["idle"] if name == "1f1b" else base
                r["idle_vs_1f1b"] = r["idle"] / base
                rows.append(r)
    return rows


def markdown(rows: list[dict]) -> list[str]:
    def f(x):
        return "—" if x is None else (x if isinstance(x, str) else f"{x:.3f}")
    out = ["| schedule | PP | M | bubble | published | torch's plan | idle / 1F1B's | peak (stages) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['schedule']} | {r['pp']} | {r['m']} | {f(r['bubble'])} | {f(r['published'])} | "
                   f"{f(r['torch'])} | {r['idle_vs_1f1b']:.3f} | {r['peak']:g} |")
    return out
