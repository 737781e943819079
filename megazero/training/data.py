"""The data a run trains on: the vocabulary size, the train/valid datasets, this rank's micro-batches.

:class:`MicroBatchSource` is what the loop reads micro-batches from: only the entries this
pipeline stage uses (``ModelStages.input_keys``, Megatron's ``get_batch``), read and pinned on a
background thread while the previous step runs, in an order fixed by ``consumed_samples``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megazero.config.configs import DataConfig, ScheduleConfig
from megazero.context_parallel.chunks import slice_for_rank
from megazero.parallel.topology import Topology


class MockGPTDataset:
    """Uniformly random tokens, reproducible per sample index (``--mock-data``)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.n, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, int(i)])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


def vocab_size_of(data: DataConfig) -> int:
    """The real vocabulary size: ``--vocab-size`` with mock data, else the tokenizer's.
    Needs no process group (the tokenizer files are read here, before any is created)."""
    if data.mock:
        if data.vocab_size is None:
            raise ValueError("--mock-data needs --vocab-size")
        return data.vocab_size
    from megazero.data import build_tokenizer
    return build_tokenizer(data.tokenizer).vocab_size


def sample_counts(schedule: ScheduleConfig) -> tuple[int, int, int]:
    """(train, valid, test) samples the run will draw: Megatron's ``get_train_valid_test_num_samples``
    (core_v0.19.0 ``megatron/training/training.py``) with ``B = --global-batch-size``: train
    ``--train-samples`` or ``train_iters * B``, raised to what the batch schedule consumes in
    ``train_iters`` iterations where that is more (a ramp-up's last ramp iteration may pass
    ``--train-samples``, as Megatron's ``update_train_iters`` counts; a step schedule's sizes
    are not ``B``); valid ``eval_iters * B`` for every validation (each ``eval_interval``
    iterations plus the one at the end of training); test ``eval_iters * B``."""
    b, s = schedule.global_batch_size, schedule
    train = s.train_samples if s.train_samples else s.train_iters * b
    train = max(train, s.batches.consumed_after(s.train_iters))
    evals = (s.train_iters // s.eval_interval + 1) if s.eval_interval else 0
    return train, max(evals * s.eval_iters * b, 1), s.eval_iters * b


def build_datasets(data: DataConfig, schedule: ScheduleConfig, vocab_size: int):
    """(train, valid, test) datasets (None where a split is empty or not asked for). Collective
    when process groups exist: rank 0 builds the index caches under ``--data-cache-path`` while
    the others wait at a barrier. ``--data-path`` with ``--split``: three ranges of the same
    documents; ``--train/valid/test-data-path``: each split from all documents of its own
    prefixes (Megatron's ``blend_per_split``); mock data: the test split when ``--split`` gives it
    a share."""
    from megazero.data.gpt_dataset import split_ranges
    counts = sample_counts(schedule)
    if data.mock:
        d0, d1 = split_ranges(data.split, 1000)[2]
        test = counts[2] > 0 and d1 > d0
        return (MockGPTDataset(counts[0], data.seq_length, vocab_size, data.seed),
                MockGPTDataset(counts[1], data.seq_length, vocab_size, data.seed + 1),
                MockGPTDataset(counts[2], data.seq_length, vocab_size, data.seed + 2) if test else None)
    from megazero.data import build_train_valid_test_datasets
    rank = dist.get_rank() if dist.is_initialized() else 0
    build = lambda paths, split, sizes: build_train_valid_test_datasets(  # noqa: E731
        list(paths), split, data.seq_length, data.seed, sizes, cache_dir=data.cache_path, is_builder=rank == 0,
        barrier=dist.barrier if dist.is_initialized() else None, vocab_size=vocab_size)  # ids checked
    per_split = data.per_split_paths
    if per_split is None:
        datasets = build(data.data_path, data.split, counts)
    else:  # split k takes every document of its own prefixes
        whole = ("1,0,0", "0,1,0", "0,0,1")
        datasets = tuple(None if not paths else build(paths, whole[k], tuple(n if i == k else 0 for i, n in
                                                                              enumerate(counts)))[k]
                         for k, paths in enumerate(per_split))
    if datasets[0] is None:
        where = (f"--data-path {list(data.data_path)} with --split {data.split!r}" if per_split is None
                 else f"--train-data-path {list(per_split[0])}")
        raise ValueError(f"no training documents in {where}")
    return datasets


@dataclass(frozen=True)
class DocumentMasks:
    """Megatron's ``get_ltor_masks_and_position_ids`` switches and the end-of-document id.

    For input tokens ``t [b, s]`` and ``e = (t == eod)``, the document of position ``j`` is the
    number of eod tokens strictly before ``j`` (an eod token ends its own document):

    * ``eod_mask_loss``: ``loss_mask[j] = 0`` where ``t[j]`` is eod (the prediction after it);
    * ``reset_position_ids``: ``position_ids[j] = j - start(j)``, ``start(j)`` = 1 + the index of
      the last eod before ``j`` (0 if none): positions restart after each eod;
    * ``reset_attention_mask``: ``attention_mask [b, 1, s, s]`` bool, True where query ``q`` may
      not attend to key ``k``: ``k > q`` or ``doc(k) != doc(q)`` (block-diagonal within causal).
    """

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def from_config(cls, data: DataConfig, vocab_size: int) -> "DocumentMasks | None":
        """None unless one of the three flags is on. eod: the tokenizer's; with mock data and no
        ``--tokenizer-type``, ``vocab_size - 1`` (NullTokenizer's convention here)."""
        flags = dict(eod_mask_loss=data.eod_mask_loss, reset_position_ids=data.reset_position_ids,
                     reset_attention_mask=data.reset_attention_mask)
        if not any(flags.values()):
            return None
        if data.tokenizer.type is None:
            return cls(eod=vocab_size - 1, **flags)
        from megazero.data import build_tokenizer
        return cls(eod=build_tokenizer(data.tokenizer).eod, **flags)

    @property
    def per_document(self) -> frozenset:
        """The micro-batch entries these switches make per document (``ModelStages.input_keys``)."""
        return frozenset({"attention_mask"} if self.reset_attention_mask else set()) | frozenset(
            {"position_ids"} if self.reset_position_ids else set())

    def __call__(self, tokens: torch.Tensor) -> dict:
        """``loss_mask``, ``position_ids`` and (with ``reset_attention_mask``) ``attention_mask``."""
        b, s = tokens.shape
        is_eod = tokens == self.eod
        arange = torch.arange(s, device=tokens.device)
        out = {"loss_mask": (~is_eod if self.eod_mask_loss else torch.ones_like(is_eod)).to(torch.float32)}
        out["position_ids"] = arange.unsqueeze(0).expand(b, s)
        if self.reset_position_ids:  # start(j): cummax of (i + 1) over eods i < j
            after_eod = torch.where(is_eod, arange + 1, torch.zeros_like(arange)).cummax(dim=1).values
            start = torch.cat([torch.zeros_like(after_eod[:, :1]), after_eod[:, :-1]], dim=1)
            out["position_ids"] = arange - start
        if self.reset_attention_mask:
            doc = is_eod.long().cumsum(dim=1) - is_eod.long()
            future = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
            out["attention_mask"] = (future | (doc.unsqueeze(2) != doc.unsqueeze(1))).unsqueeze(1)
        return out


MICRO_BATCH_KEYS = frozenset({"tokens", "labels", "loss_mask", "position_ids", "attention_mask"})
_READ_KEYS = frozenset({"tokens", "labels", "loss_mask", "attention_mask"})  # need the samples' tokens


class _ReadMicroBatch:
    """Runs on the reader thread: dataset samples ``indices`` -> this stage's CPU tensors
    (pinned when they go to a CUDA device). Holds no reference to the :class:`MicroBatchSource`."""

    def __init__(self, dataset, keys: frozenset, masks: DocumentMasks | None, pin: bool, cp: tuple[int, int]):
        self.dataset, self.keys, self.masks, self.pin, self.cp = dataset, keys, masks, pin, cp

    def __call__(self, indices: list[int]) -> dict:
        from megazero.data.samplers import collate, get_tokens_and_labels
        if not self.keys & _READ_KEYS and (self.masks is None or not self.keys):
            return {}  # nothing of this stage comes from the samples: no read at all
        tokens, labels = get_tokens_and_labels(collate([self.dataset[i] for i in indices]))
        if self.masks is not None:
            batch = {"tokens": tokens, "labels": labels, **self.masks(tokens)}
        else:
            batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
        batch = {k: v for k, v in batch.items() if k in self.keys}
        if self.cp[0] > 1:  # this CP rank's chunks only (masks and positions were made on the whole sequence)
            batch = {k: slice_for_rank(v, 1, *self.cp) for k, v in batch.items()}
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin else batch


class MicroBatchSource:
    """This rank's micro-batches of ``dataset`` from ``consumed_samples`` on, read ahead.

    Sample order: :func:`~megazero.data.samplers.micro_batch_indices` (Megatron's pretraining
    sampler; after ``k`` micro-batches per DP rank the next one starts at sample
    ``consumed_samples + k * micro_batch_size * DP``), whatever number of micro-batches each
    iteration takes, so a run resumed at ``consumed_samples`` continues exactly. Each dict holds
    the ``keys`` this stage reads (``ModelStages.input_keys``; default: all five), equal to what every rank read before
    (``tokens``/``labels`` ``[b, s]`` int64, ``loss_mask`` float32, ``position_ids``, and
    ``attention_mask`` ``[b, 1, s, s]`` with ``masks``); a stage that needs no sample gets ``{}``
    and reads nothing (it still raises when the samples run out, as the others do). Under context
    parallelism each entry holds only this CP rank's load-balanced chunks of the sequence
    (:func:`~megazero.context_parallel.chunks.slice_for_rank`, on the reader thread: the masks and
    positions are made on the whole sequence first), ``[b, s / CP]``.

    ``num_workers`` (``--num-workers``): 0 reads on the calling thread inside :meth:`next_batch`;
    1 or more, one daemon thread reads and pins (CUDA only) up to ``read_ahead`` micro-batches
    ahead while the step runs (samples are memory-mapped reads plus a small collate under the
    GIL, so a second thread would not read faster; Megatron's ``--num-workers`` counts DataLoader
    worker processes). The copy to ``device`` is issued on the calling thread, ``non_blocking``
    from pinned memory. A dataset error is raised by :meth:`next_batch` as the dataset raised it.
    """

    def __init__(self, dataset, consumed_samples: int, *, seq_length: int, micro_batch_size: int,
                 topo: Topology, device, keys: frozenset | None = None, masks: DocumentMasks | None = None,
                 cycle: bool = False, num_workers: int = 1, read_ahead: int = 1):
        from megazero.data.samplers import ReadAhead, micro_batch_indices
        self.device = torch.device(device)
        self.keys = MICRO_BATCH_KEYS if keys is None else frozenset(keys)
        unknown = self.keys - MICRO_BATCH_KEYS
        if unknown:
            raise ValueError(f"unknown micro-batch keys {sorted(unknown)}; known: {sorted(MICRO_BATCH_KEYS)}")
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self.position_ids = None  # without masks: arange(s) (this CP rank's positions) made once on the device
        cp = (getattr(topo, "cp", 1), getattr(topo, "cp_rank", 0))  # (CP, this rank's); tests pass (dp_rank, dp) only
        if masks is None and "position_ids" in self.keys:
            positions = slice_for_rank(torch.arange(seq_length, device=self.device), 0, *cp)
            self.position_ids = positions.unsqueeze(0).expand(micro_batch_size, -1)
        read = _ReadMicroBatch(dataset, self.keys, masks, self.pinned, cp)
        reads = bool(self.keys & _READ_KEYS) or (masks is not None and bool(self.keys))
        work = micro_batch_indices(len(dataset), consumed_samples, micro_batch_size, topo.dp_rank, topo.dp, cycle)
        self.reader = ReadAhead(work, read, ahead=read_ahead, threaded=reads and num_workers > 0,
                                name=f"megazero-data-dp{topo.dp_rank}")

    def next_batch(self, num_micro_batches: int, read_ahead: int | None = None) -> list[dict]:
        """The next ``num_micro_batches`` micro-batch dicts on the device; ``read_ahead``: how
        many to read ahead for the next call (its count, e.g. under batch-size ramp-up)."""
        out = []
        for batch in self.reader.take(num_micro_batches, read_ahead):
            batch = {k: v.to(self.device, non_blocking=self.pinned) for k, v in batch.items()}
            if self.position_ids is not None:
                batch["position_ids"] = self.position_ids
            out.append(batch)
        return out

    def close(self) -> None:
        """Stop the reader thread (also on garbage collection and at interpreter exit)."""
        self.reader.close()

    def __enter__(self) -> "MicroBatchSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
