"""The data a run trains on: the vocabulary size, the train/valid datasets, this rank's micro-batches."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

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


def uses_mock_data(args) -> bool:
    return bool(args.mock_data or not args.data_path)


def vocab_size_of(args) -> int:
    """The real vocabulary size: ``--vocab-size`` with mock data, else the tokenizer's.
    Needs no process group (the tokenizer files are read here, before any is created)."""
    if uses_mock_data(args):
        if args.vocab_size is None:
            raise ValueError("--mock-data needs --vocab-size")
        return args.vocab_size
    from megazero.data import build_tokenizer
    return build_tokenizer(args).vocab_size


def with_checkpoint_tokenizer(args):
    """``args`` with the tokenizer flags recorded by ``--load``'s latest checkpoint when no
    ``--tokenizer-type`` is given (an imported model: ``convert_checkpoint.py from-hf`` records
    ``DIR/tokenizer``), so it trains and saves with its own tokenizer. No process group needed."""
    if args.tokenizer_type is not None or not args.load:
        return args
    from megazero.checkpoint.files import latest_iteration, read_metadata
    from megazero.data.tokenizers import saved_tokenizer_flags
    iteration = latest_iteration(args.load)
    if iteration is None:
        return args
    flags = saved_tokenizer_flags(read_metadata(args.load, iteration).get("args", {}), args.load)
    return args.replace(**flags) if flags else args


def sample_counts(args) -> tuple[int, int]:
    """(train, valid) samples the run will draw: ``train_iters * B`` and, for every evaluation
    (each ``eval_interval`` iterations plus one), ``eval_iters * B``."""
    train = args.train_iters * args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 0
    return train, max(evals * args.eval_iters * args.global_batch_size, 1)


def build_datasets(args, vocab_size: int):
    """(train, valid) datasets. Collective when process groups exist: rank 0 builds the index
    caches under ``--data-cache-path`` while the others wait at a barrier."""
    train_samples, valid_samples = sample_counts(args)
    if uses_mock_data(args):
        return (MockGPTDataset(train_samples, args.seq_length, vocab_size, args.seed),
                MockGPTDataset(valid_samples, args.seq_length, vocab_size, args.seed + 1))
    from megazero.data import build_train_valid_test_datasets
    rank = dist.get_rank() if dist.is_initialized() else 0
    train, valid, _ = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed, (train_samples, valid_samples, 0),
        cache_dir=args.data_cache_path, is_builder=rank == 0,
        barrier=dist.barrier if dist.is_initialized() else None)
    if train is None:
        raise ValueError(f"--split {args.split!r} leaves no training documents in --data-path {args.data_path}")
    return train, valid


def micro_batch_iterator(dataset, consumed_samples: int, *, seq_length: int, micro_batch_size: int,
                         topo: Topology, device, cycle: bool = False):
    """Yield this DP rank's micro-batches (dicts of tensors on ``device``) from ``consumed_samples`` on."""
    from megazero.data.samplers import PretrainingSampler, collate, get_tokens_and_labels
    position_ids = torch.arange(seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    start = consumed_samples
    while True:
        sampler = PretrainingSampler(len(dataset), start, micro_batch_size, topo.dp_rank, topo.dp)
        for indices in sampler:
            tokens, labels = (t.to(device) for t in get_tokens_and_labels(collate([dataset[i] for i in indices])))
            yield {"tokens": tokens, "labels": labels, "position_ids": position_ids,
                   "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
        if not cycle:
            raise RuntimeError(f"ran out of training samples ({len(dataset)})")
        start = 0
