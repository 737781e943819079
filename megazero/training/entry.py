"""``pretrain``: the entry point of ``pretrain_gpt.py`` around :func:`setup` and
:meth:`Trainer.train` -- signal handlers, the one-line reports of checkpoint and data errors,
and the teardown of the process group on the way out."""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch.distributed as dist

from megazero.checkpoint import CheckpointError
from megazero.data.indexed_dataset import DataError
from megazero.training.build import setup
from megazero.training.signals import ExitSignal


def pretrain(args, model_provider=None, forward_step_func=None) -> int:
    """Entry point of ``pretrain_gpt.py``: train, and return the process exit code.

    Errors are printed with the failing rank; a checkpoint problem prints one line naming the
    file. The process group is torn down on the way out, so peers see a closed connection
    instead of waiting for the collective timeout.
    """
    signums = {signal.SIGTERM, signal.SIGUSR1, signal.Signals[args.exit_signal.upper()]}
    exit_signal = ExitSignal.install(sorted(signums)) if args.exit_signal_handler else None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    try:
        trainer = setup(args, model_provider, forward_step_func)
        trainer.train(exit_signal)
        trainer.tb.close()
    except CheckpointError as e:
        print(f"rank {rank}: checkpoint error: {e}", file=sys.stderr, flush=True)
        return 1
    except DataError as e:  # a corrupt/missing/empty dataset, an id outside the vocabulary: one line
        print(f"rank {rank}: data error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        print(f"rank {rank}: training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    return 0
