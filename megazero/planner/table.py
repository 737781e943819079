"""The planner's table and its MoE line (:mod:`megazero.planner.cli`)."""

from __future__ import annotations

from megazero.planner.memory import GiB, active_params

from .timing import Ranked


def _fmt(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_table(ranked: list[Ranked], gpu_memory_gb: float, moe: bool = False, cp: bool = False,
                 schedules: bool = False) -> str:
    """The table, one row per ranked layout with its estimated ``s/step``; ``moe`` adds the expert grid (EP, ETP, EDP), the experts' share of ``params/rank``
    and the EDP and EP (dispatcher) parts of the communication; ``cp`` the CP column and the CP
    attention's part (``dp`` is then the gradients' over DP x CP); ``schedules`` the pipeline schedule
    column (``--pipeline-schedule`` / ``--try-pipeline-schedules``; ``-``: 1F1B or interleaved 1F1B)."""
    parts = ["dp", "tp", "pp"] + (["edp", "ep"] if moe else []) + (["cp"] if cp else [])
    grid = f" {'EP':>3} {'ETP':>3} {'EDP':>4}" if moe else ""
    head = (f"{'TP':>3} {'PP':>3} {'VP':>3} " + (f"{'CP':>3} " if cp else "") + f"{'DP':>4} {'ZeRO':>4}{grid} "
            f"{'M':>4} {'stage':>5} {'params/rank':>13} " + (f"{'experts':>13} " if moe else "")
            + f"{'states':>8} {'activ.':>8} {'total':>8} {'comm/step':>9} "
            + " ".join(f"{('(' if i == 0 else '') + n + (')' if i == len(parts) - 1 else ''):>8}"
                       for i, n in enumerate(parts)) + f"  fits {gpu_memory_gb:g} GiB {'s/step':>8}"
            + (f" {'schedule':>16}" if schedules else ""))
    rows = [head, "-" * len(head)]
    for r in ranked:
        x = r.layout
        grid = f" {x.ep:>3} {x.etp:>3} {x.edp:>4}" if moe else ""
        rows.append(f"{x.tp:>3} {x.pp:>3} {x.vp:>3} " + (f"{x.cp:>3} " if cp else "")
                    + f"{x.dp:>4} {x.zero:>4}{grid} {x.micro_batches:>4} {x.stage:>5} "
                    f"{x.params:>13,} " + (f"{x.expert_params:>13,} " if moe else "")
                    + f"{_fmt(x.model_state_bytes)} {_fmt(x.activation_bytes)} {_fmt(x.total_bytes)} "
                    f"{_fmt(x.comm_bytes):>9} " + " ".join(_fmt(getattr(x, f"comm_{n}_bytes")) for n in parts)
                    + f"  {'yes' if x.fits else '-':>3} {' ' * len(f'{gpu_memory_gb:g}')}     {r.time.total:8.2f}"
                    + (f" {x.schedule or '-':>16}" if schedules else ""))
    return "\n".join(rows)


def moe_line(shape) -> str:
    """What the planner read of an MoE model: experts, top-k, MoE layers, expert and active parameters."""
    moe = shape.moe
    return (f"MoE: {moe.num_experts} experts (FFN {moe.ffn_hidden_size}), top-{moe.router_topk}, "
            f"{moe.num_moe_layers} of {shape.num_layers} layers"
            + (f", shared expert {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size else "")
            + f"; {active_params(shape):,} parameters active per token; {moe.token_dispatcher} dispatcher"
            + (f", capacity factor {moe.capacity_factor:g}" if moe.capacity_factor is not None else ", dropless"))


