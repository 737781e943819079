"""``pretrain_gpt.py`` with one fault, for tests/faults/test_restart.py: rank RANK SIGKILLs itself
at its first forward step after ITERATIONS iterations (mid-iteration ITERATIONS + 1), in the first
launch attempt only (``TORCHELASTIC_RESTART_COUNT`` and ``SLURM_RESTART_COUNT`` 0 or unset), so a
restarted attempt trains on undisturbed. MICRO_BATCHES: forward steps per iteration on that rank.

    torchrun --max-restarts 1 ... tests/faults/kill_rank.py RANK ITERATIONS MICRO_BATCHES <pretrain_gpt.py flags>

The fault goes in through ``pretrain``'s ``forward_step_func`` (Megatron's hook), as in
tests/faults/test_hang.py: nothing of megazero is patched."""

import os
import signal
import sys

from megazero.arguments import parse_args
from megazero.model.stages import gpt_forward_step
from megazero.training import pretrain

from pretrain_gpt import model_provider


def main(argv: list[str]) -> int:
    kill_rank, after, micro_batches, flags = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    first = all(os.environ.get(k, "0") == "0" for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    armed = first and int(os.environ.get("RANK", 0)) == kill_rank
    calls = []

    def forward_step(chunk, micro_batch, input_tensor):
        calls.append(1)
        if armed and len(calls) == after * micro_batches + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return gpt_forward_step(chunk, micro_batch, input_tensor)

    args = parse_args(flags, prog="pretrain_gpt.py", training=True)
    return pretrain(args, model_provider=model_provider, forward_step_func=forward_step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
