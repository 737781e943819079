"""PretrainingSampler (Megatron semantics, resume continuity) and collation."""
import numpy as np
import pytest
import torch

from megazero.data.samplers import (PretrainingSampler, build_pretraining_data_loader, collate,
                                    get_tokens_and_labels)


def test_megatron_layout():
    ranks = [list(PretrainingSampler(20, 0, 2, r, 3)) for r in range(3)]
    assert ranks[0] == [[0, 1], [6, 7], [12, 13]]
    assert ranks[1] == [[2, 3], [8, 9], [14, 15]]
    assert ranks[2] == [[4, 5], [10, 11], [16, 17]]
    assert all(len(PretrainingSampler(20, 0, 2, r, 3)) == 3 for r in range(3))


def test_not_drop_last_tail():
    tails = [list(PretrainingSampler(20, 0, 2, r, 3, drop_last=False))[3:] for r in range(3)]
    assert tails == [[[18, 19]], [], []]
    assert [len(PretrainingSampler(20, 0, 2, r, 3, drop_last=False)) for r in range(3)] == \
        [4, 3, 3]


@pytest.mark.parametrize("mbs, dp, gbs", [(2, 2, 8), (1, 4, 4), (3, 1, 6)])
def test_resume_continues_on_the_next_sample(mbs, dp, gbs):
    total, steps_per_iter = 200, gbs // (mbs * dp)
    full = [list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    for iters_done in (0, 1, 5):
        consumed = iters_done * gbs
        resumed = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
        for r in range(dp):
            assert resumed[r] == full[r][iters_done * steps_per_iter:]
    # every sample of the run is seen exactly once across ranks
    seen = sorted(i for r in range(dp) for batch in full[r] for i in batch)
    assert seen == list(range(len(seen))) and total - len(seen) < mbs * dp


def test_bad_arguments():
    with pytest.raises(ValueError):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_collate_and_loader():
    data = [{"text": np.arange(i, i + 5, dtype=np.int64)} for i in range(10)]
    batch = collate(data[:3])
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (3, 5)
    tokens, labels = get_tokens_and_labels(batch)
    assert tokens.shape == labels.shape == (3, 4)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    loader = build_pretraining_data_loader(data, consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2)
    firsts = [b["text"][:, 0].tolist() for b in loader]
    assert firsts == [[6, 7]]
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None


def test_micro_batch_indices_continue_the_sampler_and_cycle_or_run_out():
    from megazero.data.samplers import micro_batch_indices
    it = micro_batch_indices(10, 4, 1, 1, 2)
    assert [next(it) for _ in range(3)] == [[5], [7], [9]]
    with pytest.raises(RuntimeError, match=r"ran out of training samples \(10\)"):
        next(it)
    cyc = micro_batch_indices(10, 6, 2, 0, 2, cycle=True)
    assert [next(cyc) for _ in range(4)] == [[6, 7], [0, 1], [4, 5], [0, 1]]  # partial chunks dropped
