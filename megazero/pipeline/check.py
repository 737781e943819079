"""Every rank's plan checked by the simulator before a run (no processes needed)."""

from __future__ import annotations

from .bounds import in_flight_bound
from .plan import build_plan, schedule_name
from .simulate import simulate


def check_plans(pp: int, vp: int, m: int, schedule: str | None = None) -> dict:
    """Build all ``pp`` ranks' plans of ``schedule`` for ``m`` micro-batches, training and
    forward-only, and simulate them: no deadlock -- with sends in the background and under NCCL's
    stream model with the communicator's posting (``comm="nccl"``, :mod:`.streams`) -- every
    F/B/W once and in order, each rank's live chunk-activations within
    :func:`~.bounds.in_flight_bound`. Returns the training plans'
    simulation; raises ``ValueError`` naming the schedule and what failed."""
    name = schedule_name(pp, vp, schedule)
    try:
        plans = [build_plan(pp, vp, m, r, schedule=schedule) for r in range(pp)]
        res = simulate(plans, 1.0, 1.0, 1.0, comm="nccl")
        simulate([build_plan(pp, vp, m, r, forward_only=True, schedule=schedule) for r in range(pp)], comm="nccl")
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"pipeline schedule {name} (PP {pp}, VP {vp}, M {m}): {e}") from e
    over = [r for r in range(pp) if res["max_in_flight"][r] > in_flight_bound(pp, vp, m, r, schedule)]
    if over:
        raise ValueError(f"pipeline schedule {name} (PP {pp}, VP {vp}, M {m}): ranks {over} hold more activations "
                         "than the schedule's bound (internal error)")
    return res
