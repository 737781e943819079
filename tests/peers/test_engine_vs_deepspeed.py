"""``megazero.initialize`` against ``deepspeed.initialize`` (DeepSpeed 0.19.8, CPU accelerator,
gloo), issue 31: the same tiny random Hugging Face model (RobertaForMaskedLM, GPT2LMHeadModel),
weights, batches and ds_config (AdamW, gradient accumulation 2, clipping 0.3, Hugging Face's two
param groups) at ZeRO 1/2/3 over DP 2 give DeepSpeed's loss at every micro-batch of 3 optimizer
steps (fp32). The workers are bench/engine_equivalence.py's, which also prints the table."""

import pytest

from bench.engine_equivalence import GAS, STEPS, worker
from megazero.testing import run_distributed
from tests.engine.hf_tiny import batches

TOL = 1e-5


@pytest.mark.parametrize("kind", ["roberta", "gpt2"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_megazero_initialize_gives_deepspeeds_losses(kind, stage):
    data = batches(kind, STEPS, 2, GAS)
    ours = run_distributed(worker, 2, "megazero", kind, stage, data, timeout_s=600)
    theirs = run_distributed(worker, 2, "deepspeed", kind, stage, data, timeout_s=600)
    assert [len(r) for r in ours] == [len(r) for r in theirs] == [STEPS * GAS] * 2
    worst = max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(ours[r], theirs[r]))
    assert worst <= TOL, (kind, stage, worst, ours, theirs)
