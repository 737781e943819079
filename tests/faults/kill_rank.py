"""``pretrain_gpt.py`` with one fault, for tests/faults/test_restart.py: with
``MEGAZERO_TEST_KILL=RANK:ITERATIONS:MICRO_BATCHES`` rank RANK SIGKILLs itself at its first forward
step after ITERATIONS iterations (mid-iteration ITERATIONS + 1; MICRO_BATCHES: forward steps per
iteration on that rank), in the first launch attempt only (``TORCHELASTIC_RESTART_COUNT`` and
``SLURM_RESTART_COUNT`` 0 or unset), so a restarted attempt trains on undisturbed. Only this test
script reads the variable; megazero itself has no fault switch.

    MEGAZERO_TEST_KILL=1:5:2 torchrun --max-restarts 1 ... tests/faults/kill_rank.py <pretrain_gpt.py flags>
    TRAIN_SCRIPT=tests/faults/kill_rank.py MEGAZERO_TEST_KILL=1:5:2 sbatch examples/slurm/pretrain_gpt.sbatch

The fault goes in through ``pretrain``'s ``forward_step_func`` (Megatron's hook), as in
tests/faults/test_hang.py: nothing of megazero is patched."""

import os
import signal
import sys

from megazero.arguments import parse_args
from megazero.config.failures import warnings_as_lines
from megazero.config.rank import current_rank
from megazero.model.stages import gpt_forward_step
from megazero.training import pretrain

from pretrain_gpt import model_provider


def main(flags: list[str]) -> int:
    kill_rank, after, micro_batches = (int(v) for v in os.environ["MEGAZERO_TEST_KILL"].split(":"))
    first = all(os.environ.get(k, "0") == "0" for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    armed = first and current_rank() == kill_rank
    calls = []

    def forward_step(chunk, micro_batch, input_tensor):
        calls.append(1)
        if armed and len(calls) == after * micro_batches + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return gpt_forward_step(chunk, micro_batch, input_tensor)

    with warnings_as_lines(current_rank()):
        args = parse_args(flags, prog="pretrain_gpt.py", training=True)
    return pretrain(args, model_provider=model_provider, forward_step_func=forward_step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
