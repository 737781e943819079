"""The micro-batch source: only the entries a stage uses, read ahead on a thread, exact resume.

Reference: ``reference_iterator`` is the loop's former ``micro_batch_iterator`` (every rank read
and collated every micro-batch on the main thread), copied here unchanged so that the source is
checked bit for bit against what training used to see, at several DP / PP layouts and with the
document-mask switches. Topologies are plain namespaces: the source reads only ``dp``,
``dp_rank``, ``is_first_stage`` and ``is_last_stage``.
"""

import gc
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megazero.data.samplers import PretrainingSampler, ReadAhead, collate, get_tokens_and_labels
from megazero.model.stages import GPTInputKeys
from megazero.training.data import MICRO_BATCH_KEYS, DocumentMasks, MicroBatchSource, MockGPTDataset

S, MBS, V = 12, 2, 7  # small vocabulary: eod (V - 1) occurs often, so the masks have documents


def reference_iterator(dataset, consumed_samples, *, seq_length, micro_batch_size, topo, device, cycle=False,
                       masks=None):
    position_ids = torch.arange(seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    start = consumed_samples
    while True:
        sampler = PretrainingSampler(len(dataset), start, micro_batch_size, topo.dp_rank, topo.dp)
        for indices in sampler:
            tokens, labels = (t.to(device) for t in get_tokens_and_labels(collate([dataset[i] for i in indices])))
            if masks is not None:
                yield {"tokens": tokens, "labels": labels, **masks(tokens)}
                continue
            yield {"tokens": tokens, "labels": labels, "position_ids": position_ids,
                   "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
        if not cycle:
            raise RuntimeError(f"ran out of training samples ({len(dataset)})")
        start = 0


class CountingDataset(MockGPTDataset):
    """Mock samples; counts reads and raises at sample ``fail_at``."""

    def __init__(self, n, fail_at=None, delay_s=0.0):
        super().__init__(n, S, V, seed=5)
        self.reads, self.fail_at, self.delay_s = [], fail_at, delay_s

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"sample {i}: document index out of range in data.idx")
        time.sleep(self.delay_s)
        self.reads.append(i)
        return super().__getitem__(i)


def topo(dp=1, dp_rank=0, pp=1, pp_rank=0):
    return SimpleNamespace(dp=dp, dp_rank=dp_rank, is_first_stage=pp_rank == 0, is_last_stage=pp_rank == pp - 1)


def stage_keys(t, masks=None, rope=False) -> frozenset:
    """The GPT stages' ``input_keys`` (``ModelStages``) for topology ``t`` and these masks."""
    return GPTInputKeys(t.is_first_stage, t.is_last_stage, rope)(masks.per_document if masks else frozenset())


def source(ds, consumed, t, **kw):
    return MicroBatchSource(ds, consumed, seq_length=S, micro_batch_size=MBS, topo=t, device="cpu", **kw)


MASKS = [None, DocumentMasks(V - 1, eod_mask_loss=True), DocumentMasks(V - 1, reset_position_ids=True),
         DocumentMasks(V - 1, reset_attention_mask=True), DocumentMasks(V - 1, True, True, True)]


def assert_same(got: dict, want: dict, keys):
    assert set(got) == set(keys) & set(want), (sorted(got), sorted(keys))
    for k, v in got.items():
        assert v.dtype == want[k].dtype and v.shape == want[k].shape and torch.equal(v, want[k]), k


@pytest.mark.parametrize("masks", MASKS, ids=["none", "eod-loss", "reset-pos", "reset-attn", "all"])
@pytest.mark.parametrize("dp, pp", [(1, 1), (2, 2), (4, 3)])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_micro_batches_equal_the_former_iterator(masks, dp, pp, num_workers):
    """Every DP rank and pipeline stage, micro-batch counts changing between iterations (ramp-up):
    each stage's entries are bit-equal to the former iterator's; middle stages read no sample
    unless a per-document entry is needed there."""
    counts = [1, 3, 2, 4]
    for dp_rank in range(dp):
        for pp_rank in range(pp):
            t = topo(dp, dp_rank, pp, pp_rank)
            keys = stage_keys(t, masks, rope=True)
            ds = CountingDataset(200)
            ref = reference_iterator(CountingDataset(200), 6, seq_length=S, micro_batch_size=MBS, topo=t,
                                     device="cpu", masks=masks)
            with source(ds, 6, t, keys=keys, masks=masks, num_workers=num_workers, read_ahead=counts[0]) as src:
                for k, m in enumerate(counts):
                    got = src.next_batch(m, read_ahead=counts[(k + 1) % len(counts)])
                    assert len(got) == m
                    for g in got:
                        assert_same(g, next(ref), keys)
            middle = 0 < pp_rank < pp - 1
            if middle and (masks is None or not (masks.reset_attention_mask or masks.reset_position_ids)):
                assert ds.reads == [] and keys == frozenset()


def test_stage_keys_follow_megatron_get_batch():
    reset = DocumentMasks(V - 1, reset_position_ids=True, reset_attention_mask=True)
    first, middle, last = topo(pp=3, pp_rank=0), topo(pp=3, pp_rank=1), topo(pp=3, pp_rank=2)
    assert stage_keys(first) == {"tokens", "position_ids"}
    assert stage_keys(last) == {"labels", "loss_mask"}
    assert stage_keys(middle) == frozenset()
    assert stage_keys(topo()) == {"tokens", "position_ids", "labels", "loss_mask"}  # first and last virtual stage
    assert stage_keys(middle, reset) == {"attention_mask"}  # learned positions: only the embedding reads them
    assert stage_keys(middle, reset, rope=True) == {"attention_mask", "position_ids"}
    assert stage_keys(last, reset, rope=True) == {"labels", "loss_mask", "attention_mask", "position_ids"}
    assert stage_keys(topo(), reset) == MICRO_BATCH_KEYS


def test_resume_depends_only_on_consumed_samples():
    """Iterations of 2, 4, 1, 3 micro-batches from sample 0 and a source started at the consumed
    count after the first two continue on the same micro-batches."""
    t = topo(dp=2, dp_rank=1)
    with source(CountingDataset(300), 0, t) as a:
        full = [mb for m in (2, 4, 1, 3) for mb in a.next_batch(m, read_ahead=4)]
    consumed = (2 + 4) * MBS * t.dp
    with source(CountingDataset(300), consumed, t) as b:
        resumed = b.next_batch(1) + b.next_batch(3)
    for g, w in zip(resumed, full[6:], strict=True):
        assert_same(g, w, MICRO_BATCH_KEYS)


def test_reads_ahead_within_the_bound():
    """While the caller computes, the thread reads the next ``read_ahead`` micro-batches, no more."""
    ds = CountingDataset(400)
    with source(ds, 0, topo(), read_ahead=3) as src:
        wait_for(lambda: len(ds.reads) == 3 * MBS)
        time.sleep(0.05)
        assert len(ds.reads) == 3 * MBS  # bounded: nothing beyond the first three
        src.next_batch(2, read_ahead=5)
        wait_for(lambda: len(ds.reads) == (2 + 5) * MBS)
        time.sleep(0.05)
        assert sorted(ds.reads) == list(range((2 + 5) * MBS))
        assert src.reader.thread.daemon and src.reader.thread.is_alive()
    assert not src.reader.thread.is_alive()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dataset_error_is_raised_in_the_caller_at_its_position(num_workers):
    ds = CountingDataset(400, fail_at=5 * MBS + 1)
    with source(ds, 0, topo(), read_ahead=8, num_workers=num_workers) as src:
        assert len(src.next_batch(3)) == 3  # before the bad sample: delivered
        with pytest.raises(ValueError, match=r"^sample 11: document index out of range in data.idx$"):
            src.next_batch(3)
        with pytest.raises(ValueError, match="sample 11"):
            src.next_batch(1)  # still failed, not hung
        assert num_workers == 0 or not src.reader.thread.is_alive()


@pytest.mark.parametrize("pp_rank", [0, 1, 2])
def test_running_out_raises_on_every_stage_when_reached(pp_rank):
    t = topo(pp=3, pp_rank=pp_rank)
    with source(CountingDataset(10), 0, t, keys=stage_keys(t), read_ahead=4) as src:
        assert len(src.next_batch(5)) == 5  # 10 samples, 2 per micro-batch
        for _ in range(2):  # and again: the same error, not a StopIteration
            with pytest.raises(RuntimeError, match=r"ran out of training samples \(10\)"):
                src.next_batch(1)


def test_cycle_wraps_to_the_first_sample_for_evaluation():
    t = topo(dp=2, dp_rank=0)
    with source(CountingDataset(12), 8, t, cycle=True) as src:
        got = src.next_batch(3)
    ref = reference_iterator(CountingDataset(12), 8, seq_length=S, micro_batch_size=MBS, topo=t, device="cpu",
                             cycle=True)
    for g in got:
        assert_same(g, next(ref), MICRO_BATCH_KEYS)


def test_thread_stops_on_close_and_when_dropped():
    slow = CountingDataset(1000, delay_s=0.01)
    src = source(slow, 0, topo(), read_ahead=50)
    thread = src.reader.thread
    src.close()
    thread.join(5)
    assert not thread.is_alive() and len(slow.reads) < 100
    with pytest.raises(RuntimeError, match="after close"):
        src.next_batch(1)
    dropped = source(CountingDataset(1000), 0, topo(), read_ahead=2)
    thread = dropped.reader.thread
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_no_thread_without_reads_or_workers():
    assert source(CountingDataset(20), 0, topo(pp=3, pp_rank=1), keys=frozenset()).reader.thread is None
    assert source(CountingDataset(20), 0, topo(), num_workers=0).reader.thread is None
    with pytest.raises(ValueError, match="unknown micro-batch keys"):
        source(CountingDataset(20), 0, topo(), keys={"tokens", "text"})


def test_read_ahead_keeps_order_under_a_slow_consumer():
    items = iter(range(1000))
    with ReadAhead(items, lambda i: i * i, ahead=4) as ra:
        got = []
        for n in (1, 7, 3, 10):
            got += ra.take(n, ahead=n)
            time.sleep(0.01)
    assert got == [i * i for i in range(21)]
    assert threading.active_count() >= 1


def test_values_are_not_pinned_on_cpu():
    with source(CountingDataset(20), 0, topo()) as src:
        assert not src.pinned
        assert not any(v.is_pinned() for v in src.next_batch(1)[0].values())


def wait_for(cond, timeout_s=5.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout_s, "timed out"
        time.sleep(0.005)


def test_mock_dataset_is_reproducible_per_index():
    a, b = MockGPTDataset(10, S, V, 3), MockGPTDataset(10, S, V, 3)
    assert np.array_equal(a[4]["text"], b[4]["text"]) and not np.array_equal(a[4]["text"], a[5]["text"])


@pytest.mark.parametrize("masks", [None, DocumentMasks(V - 1, eod_mask_loss=True, reset_position_ids=True)])
def test_context_parallel_ranks_get_their_chunks_only(masks):
    """CP 2 (S 12: chunks of 3): rank r holds chunks r and 3 - r of every entry, the masks and
    reset positions computed on the whole sequence first; without masks the positions are the
    chunks' true positions."""
    from megazero.context_parallel.chunks import slice_for_rank
    full = source(CountingDataset(8), 0, topo(), masks=masks).next_batch(2)
    for rank in (0, 1):
        t = SimpleNamespace(dp=1, dp_rank=0, cp=2, cp_rank=rank, is_first_stage=True, is_last_stage=True)
        got = source(CountingDataset(8), 0, t, masks=masks).next_batch(2)
        for g, f in zip(got, full):
            assert set(g) == set(f)
            for k in f:
                assert torch.equal(g[k], slice_for_rank(f[k], 1, 2, rank)), k
    if masks is None:  # rank 1 holds chunks 1 and 2: positions 3..8
        assert got[0]["position_ids"][0].tolist() == [3, 4, 5, 6, 7, 8]
