"""Pipeline parallelism: schedule plans, p2p, the runner, model chunking, schedule traces.

Imports only ``megazero.parallel.topology``-shaped objects and torch; ``build_model_chunks`` imports
``megazero.model`` lazily (the pipeline/model seam).
"""

from .chunks import (allreduce_shared_embedding_grads, build_model_chunks, chunk_layer_ranges, chunk_roles,
                     gpt_forward_step, shared_embedding_params)
from .p2p import P2PCommunicator, PipelineCommError, pipeline_tensor_shape
from .plan import (Action, P2P, build_plan, compute_order, compute_steps, format_plan, in_flight_bound,
                   schedule_name, simulate, theoretical_bubble, warmup_count)
from .schedules import forward_backward
from .trace import (ScheduleTrace, bubble_report, chrome_trace, format_bubble_report, gather_traces,
                    trace_for_step, write_pipeline_trace)

__all__ = [
    "Action", "P2P", "P2PCommunicator", "PipelineCommError", "ScheduleTrace", "allreduce_shared_embedding_grads",
    "bubble_report", "build_model_chunks", "build_plan", "chrome_trace", "chunk_layer_ranges", "chunk_roles",
    "compute_order", "compute_steps", "format_bubble_report", "format_plan", "forward_backward", "gather_traces",
    "gpt_forward_step", "in_flight_bound", "pipeline_tensor_shape", "schedule_name", "shared_embedding_params",
    "simulate", "theoretical_bubble", "trace_for_step", "warmup_count", "write_pipeline_trace",
]
