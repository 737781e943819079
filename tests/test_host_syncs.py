"""One host read per training iteration (issue 19): every device-to-host read of the loop and the
ZeRO optimizer goes through ``HostReads``; an iteration makes exactly one (the packed
per-iteration scalars: norm, loss, flags), whatever the dtype, ZeRO stage, pipeline depth and log
interval; and the number of collectives beyond the gradient traffic is one."""

import pytest

from megazero.arguments import parse_args
from megazero.testing import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "1", "--lr", "1e-3", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo", "--seed", "3",
        "--mock-data", "--vocab-size", "64", "--clip-grad", "1.0"]
ITERS = 3


def _reads_per_iteration(rank, world, pp):
    from megazero.training import setup
    out = {}
    for dtype in ([], ["--bf16"], ["--fp16"]):
        for stage in (0, 1, 2, 3):
            for log_interval in (1, 100):
                argv = TINY + dtype + ["--zero-stage", str(stage), "--log-interval", str(log_interval),
                                       "--pipeline-model-parallel-size", str(pp), "--train-iters", str(ITERS),
                                       "--global-batch-size", str(2 * world // pp)]
                trainer = setup(parse_args(argv, world_size=world))
                before = trainer.optimizer.host.count
                trainer.train(None)
                out[(tuple(dtype), stage, log_interval)] = (trainer.optimizer.host.count - before) / ITERS
                trainer.optimizer.close()
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_one_host_read_per_iteration(pp):
    results = run_distributed(_reads_per_iteration, 4, pp, timeout_s=600)
    for per_rank in results:
        bad = {k: v for k, v in per_rank.items() if v != 1.0}
        assert not bad, f"host reads per iteration other than 1: {bad}"


def test_iteration_code_reads_the_device_only_through_host_reads():
    """The modules an iteration runs through make no direct device-to-host read (the counter
    above sees only reads made through ``HostReads``, so a stray ``.item()`` would hide)."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "megazero"
    files = [p for d in ("pipeline", "zero", "tensor_parallel") for p in (root / d).glob("*.py")]
    files += [root / "model" / n for n in ("gpt.py", "transformer.py", "stages.py")]
    files += [root / "training" / n for n in ("loop.py", "agree.py", "log_step.py", "rerun.py", "result_checks.py",
                                              "stragglers.py", "faults.py")]
    pattern = re.compile(r"\.(item|tolist|cpu|numpy)\(\)")
    hits = [f"{p.relative_to(root)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith("#")]
    assert not hits, f"direct device-to-host reads: {hits}"
