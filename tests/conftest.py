"""Shared test setup: one intra-op thread in the parent so forked ranks start clean.

Multi-rank tests use :func:`megazero.testing.run_distributed` (forked gloo ranks); the
``distributed`` fixture hands it to tests.
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def distributed():
    from megazero.testing import run_distributed
    return run_distributed

# tests/peers/ runs against the real Megatron-LM and DeepSpeed in their own virtualenv
# (`make peers`, which names the folder); the main suite never collects it.
collect_ignore = ["peers"]
