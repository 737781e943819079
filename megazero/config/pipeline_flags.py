"""``--pipeline-schedule NAME``: megazero's own flag (Megatron-LM has none; it picks 1F1B or
interleaved 1F1B from ``--num-layers-per-virtual-pipeline-stage``), checked before any process
group, one line per problem.

Schedules (``megazero.pipeline.SCHEDULES``, plans in ``megazero/pipeline/plan.py``):

* ``1f1b`` (default without virtual stages), ``interleaved-1f1b`` (default with them);
* ``zb-h1``: 1F1B's order with each backward split into B (input gradient) and a deferred W
  (weight gradient): about a third of 1F1B's bubble at its memory; no virtual stages;
* ``interleaved-zb``: the same over ``--num-layers-per-virtual-pipeline-stage``'s chunks
  (``ScheduleInterleavedZeroBubble``); needs virtual stages and ``M`` a multiple of
  ``max(1, M // PP)``;
* ``zbv`` / ``dualpipev``: two chunks per rank in the V (rank ``r`` holds virtual stages ``r``
  and ``2 PP - 1 - r``). The two chunks are implied: without
  ``--num-layers-per-virtual-pipeline-stage`` the layers fold into ``2 PP`` stages of
  ``L / (2 PP)`` layers; given, it must be that number. ``dualpipev`` needs ``M >= 2 PP``
  (``ScheduleDualPipeV``'s rule). DualPipeV is DeepSeek's DualPipe "cut in half": the original
  DualPipe runs two pipelines in opposite directions and so keeps *two copies* of every stage's
  parameters (and their gradients and optimizer state); DualPipeV folds the pipeline into the V
  instead and keeps *one* copy, like ``zbv`` -- so ``dualpipev`` doubles nothing. The original
  (``dualpipe``) is refused for that doubling.

The tied word embedding (Megatron's default) with the V: the embedding (stage 0) and the output
layer (stage ``2 PP - 1``) are two chunks of pipeline rank 0, and there the output layer
multiplies by the embedding's weight itself: one parameter, its gradient the sum of both uses
(``megazero.model.stages.shared_embedding_params``). Multi-token prediction stays refused with
the V (``mtp_flags.py``).
"""

from __future__ import annotations

from megazero.config.batch_schedule import BatchSchedule

# the names of megazero.pipeline.SCHEDULES (the arguments package imports no pipeline code;
# tests/pipeline/test_plan_flags.py checks the two agree)
SCHEDULE_NAMES = ("1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
_LOOPED_VP = ("interleaved-1f1b", "interleaved-zb")


def add_pipeline_schedule_flag(g) -> None:
    g.add_argument("--pipeline-schedule", default=None, metavar="NAME",
                   help="megazero's own: the pipeline schedule, one of " + ", ".join(SCHEDULE_NAMES) +
                   " (default 1f1b, interleaved-1f1b with --num-layers-per-virtual-pipeline-stage); zb-*: backward "
                   "split into input and deferred weight gradients that fill the bubble; zbv/dualpipev: two chunks "
                   "per rank in a V, implied (docs/pipeline.md)")


def run_micro_batches(args, dp: int | None) -> list[int]:
    """The micro-batch counts M the run sees: ``--global-batch-size / (micro-batch x DP)``, or each
    size of ``--rampup-batch-size`` / ``--step-batch-size-schedule`` (a schedule the batch-size
    checks refuse gives the plain M); ``[]`` when unknown."""
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if dp is None or dp < 1:
        return []
    unit = mbs * dp
    ms = [(gbs if gbs is not None else unit) // unit]
    if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
        try:
            schedule = BatchSchedule.from_args(args, data_parallel_size=dp)
            iters = args.train_iters if args.train_iters is not None else schedule.train_iters(args.train_samples or 0)
            ms = sorted({b // unit for _, b, _ in schedule.stretches(iters)}) or ms
        except (ArithmeticError, TypeError, ValueError):
            pass  # named by the batch-size schedule's own check
    return ms


def check_pipeline_schedule(err, args, dp: int | None) -> None:
    """The schedule's problems, one ``err`` line each (``dp``: the data-parallel size, None if unknown)."""
    name, pp = args.pipeline_schedule, args.pipeline_model_parallel_size
    if name is None:
        return
    flag = f"--pipeline-schedule {name}"
    if name == "dualpipe":
        err(f"{flag}: the original DualPipe keeps two copies of every stage's parameters (two pipelines in "
            "opposite directions); use dualpipev, its V variant, which keeps one")
        return
    if name not in SCHEDULE_NAMES:
        err(f"{flag}: unknown schedule; choose one of {', '.join(SCHEDULE_NAMES)}")
        return
    if pp < 2:
        if name != "1f1b":
            err(f"{flag} needs --pipeline-model-parallel-size > 1 (got {pp})")
        return
    _check_chunks(err, args, name, flag, pp)
    for m in run_micro_batches(args, dp):
        if name == "dualpipev" and m < 2 * pp:
            err(f"{flag} needs at least 2 x --pipeline-model-parallel-size = {2 * pp} micro-batches, got {m}")
            return
        rounds = max(1, m // pp)
        if name == "interleaved-zb" and m % rounds:
            err(f"{flag} needs the number of micro-batches ({m}) to be a multiple of max(1, M // PP) = {rounds}")
            return


def _check_chunks(err, args, name, flag, pp) -> None:
    """Virtual stages as the schedule needs them; the V's fold."""
    per_vp, layers = args.num_layers_per_virtual_pipeline_stage, args.num_layers
    if name in _LOOPED_VP and per_vp is None:
        err(f"{flag} needs virtual stages: give --num-layers-per-virtual-pipeline-stage")
    if name in ("1f1b", "zb-h1") and per_vp is not None:
        err(f"{flag} runs one chunk per rank: drop --num-layers-per-virtual-pipeline-stage {per_vp} "
            f"(or use {'interleaved-1f1b' if name == '1f1b' else 'interleaved-zb'})")
    if name in V_SCHEDULES and layers is not None:
        if layers % (2 * pp):
            err(f"{flag}: --num-layers {layers} does not fold into the V of 2 x --pipeline-model-parallel-size "
                f"{pp} = {2 * pp} stages")
        elif per_vp is not None and per_vp * 2 * pp != layers:
            err(f"{flag} needs exactly 2 chunks per rank: --num-layers-per-virtual-pipeline-stage must be "
                f"{layers // (2 * pp)} (--num-layers {layers} / (2 x PP {pp})), got {per_vp}; or drop it")


def derive_pipeline(args) -> None:
    """The V schedules' two chunks per rank (``virtual_pipeline_model_parallel_size = 2``)."""
    if args.pipeline_schedule in V_SCHEDULES and args.pipeline_model_parallel_size > 1:
        args.virtual_pipeline_model_parallel_size = 2
