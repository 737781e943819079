"""Pipeline parallelism: schedule plans, the runner, p2p, chunk layout math, schedule traces.

Knows no model: imports only torch and takes ``megazero.parallel.topology``-shaped objects; the
chunks, the forward step, the activation shape and the shared parameters come in as arguments
(a model's ``ModelStages``, see ``megazero.model.stages``).
"""

from megazero.parallel.layout import (chunk_layer_ranges, chunk_roles, pipeline_tensor_shape, rank_of_stage,
                                      stage_of_chunk)

from .check import check_plans
from .chunks import allreduce_shared_grads
from .p2p import P2PCommunicator, PipelineCommError
from .plan import (SCHEDULES, Action, P2P, build_plan, compute_order, compute_steps, format_plan, in_flight_bound,
                   placement, plan_from_steps, schedule_name, split_backwards, theoretical_bubble, warmup_count)
from .simulate import format_timeline, simulate
from .schedules import PipelineRunner, forward_backward
from .trace import (ScheduleTrace, bubble_report, chrome_trace, format_bubble_report, gather_traces,
                    write_pipeline_trace)

__all__ = [
    "SCHEDULES", "Action", "P2P", "P2PCommunicator", "PipelineCommError", "PipelineRunner", "ScheduleTrace",
    "allreduce_shared_grads", "check_plans", "bubble_report", "build_plan", "chrome_trace", "chunk_layer_ranges", "chunk_roles",
    "compute_order", "compute_steps", "format_bubble_report", "format_timeline", "format_plan", "forward_backward", "gather_traces",
    "in_flight_bound", "pipeline_tensor_shape", "placement", "plan_from_steps", "rank_of_stage", "schedule_name", "simulate",
    "split_backwards", "stage_of_chunk", "theoretical_bubble",
    "write_pipeline_trace",
]
