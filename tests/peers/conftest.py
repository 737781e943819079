"""The peer suite (``make peers``): megazero against the real libraries pinned in
tests/peers/requirements.txt. Run without them it stops at once, naming what is missing, rather
than skipping (a skipped peer suite would look like a passing one). DeepSpeed runs on its CPU
accelerator (``DS_ACCELERATOR=cpu``) over gloo."""

import importlib.util
import os

import pytest

MISSING = [name for name in ("deepspeed", "megatron.core") if importlib.util.find_spec(name.split(".")[0]) is None
           or importlib.util.find_spec(name) is None]
SHADOW = importlib.util.find_spec("megatron")
if SHADOW is not None and any(os.path.join("tests", "megatron") in p for p in SHADOW.submodule_search_locations or []):
    raise pytest.UsageError("tests/megatron shadows the real `megatron` package (pytest's prepend import mode puts "
                            "tests/ on sys.path): run with --import-mode=importlib, as `make peers` does")
if MISSING:
    raise pytest.UsageError(f"tests/peers needs {', '.join(MISSING)} (tests/peers/requirements.txt); "
                            "run `make peers`, which builds .peers/venv with them")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def deepspeed_ranks():
    """``run(fn, world, *args)``: ``fn(rank, world, *args)`` on forked gloo ranks (megazero.testing's
    harness) with the environment DeepSpeed's ``init_distributed`` reads (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE), so ``deepspeed.initialize`` joins the rank's process group."""
    from megazero.testing import run_distributed

    def run(fn, world, *args, timeout_s=240.0):
        return run_distributed(_with_env, world, fn, args, timeout_s=timeout_s)
    return run


def _with_env(rank, world, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    return fn(rank, world, *args)
