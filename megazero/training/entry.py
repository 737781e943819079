"""``pretrain``: the entry point of ``pretrain_gpt.py`` around :func:`setup` and
:meth:`Trainer.train` -- signal handlers, the one-line reports of failures (checkpoint and data
errors as they are worded; anything else by :mod:`megazero.config.failures`: the file and the cause of an
``OSError`` such as a full disk, else the exception and the line that raised it; the traceback
only with ``--debug`` or ``MEGAZERO_DEBUG=1``), and the teardown of the process group on the way out."""

from __future__ import annotations

import signal
import sys
import traceback

import torch.distributed as dist

from megazero.checkpoint import CheckpointError
from megazero.data.indexed_dataset import DataError
from megazero.config.failures import debug_requested, report
from megazero.config.rank import current_rank
from megazero.parallel.launch import detect_launch
from megazero.training.build import build_configs, setup
from megazero.training.signals import ExitSignal


def speaks(rank: int) -> bool:
    """Whether this rank prints its failure: every rank once the process group is up (a failure
    there may be one rank's own); before it, the first rank of each node (the configs are built
    from the same flags and files on every rank, so the ranks of a node would print the same
    line: one message per single-node job, one per node where the nodes' files may differ)."""
    return rank == 0 or dist.is_initialized() or detect_launch().local_rank == 0


def pretrain(args, model_provider=None, forward_step_func=None) -> int:
    """Entry point of ``pretrain_gpt.py``: train, and return the process exit code (0; 16 or 17
    after a re-run of a NaN/Inf, Megatron-LM's codes; 1 on a failure).

    Errors are printed with the failing rank, as one line naming the file and the cause (the
    traceback too with ``--debug`` or ``MEGAZERO_DEBUG=1``). The process group is torn down on
    the way out, so peers see a closed connection instead of waiting for the collective timeout.
    """
    rank, debug = current_rank(), debug_requested()  # --debug is read with the configs, below
    try:
        config = build_configs(args)  # the tokenizer's files and --load's record are read here
        debug = debug_requested(config.logging.debug)
        schedule = config.schedule
        signums = {signal.SIGTERM, signal.SIGUSR1, signal.Signals[schedule.exit_signal.upper()]}
        exit_signal = ExitSignal.install(sorted(signums)) if schedule.exit_signal_handler else None
        trainer = setup(config, model_provider, forward_step_func)
        code = trainer.train(exit_signal)  # 16/17: a re-run's verdict (docs/reliability.md)
        trainer.tb.close()
    except (CheckpointError, DataError) as e:  # worded for the user already: the file and the cause
        kind = "checkpoint error" if isinstance(e, CheckpointError) else "data error"
        trace = f"\n{traceback.format_exc()}" if debug else ""
        if speaks(rank):
            print(f"rank {rank}: {kind}: {e}{trace}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # a full disk outside a checkpoint, a bug: one line unless --debug
        if speaks(rank):
            report(e, f"rank {rank}: training failed", debug)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    return code
