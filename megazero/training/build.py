"""What the training loop builds: datasets and micro-batches, model chunks and optimizer, RNG state.

Kept apart from :mod:`megazero.training` so the loop reads in one sitting.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from megazero.arguments import set_padded_vocab_size
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


def build_datasets(args, topo: Topology):
    """(train, valid) datasets; also records the tokenizer's padded vocab size on ``args``."""
    train_samples = args.train_iters * args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 0
    valid_samples = max(evals * args.eval_iters * args.global_batch_size, 1)
    if args.mock_data or not args.data_path:
        if args.vocab_size is None:
            raise ValueError("--mock-data needs --vocab-size")
        set_padded_vocab_size(args, args.vocab_size)
        return (MockGPTDataset(train_samples, args.seq_length, args.vocab_size, args.seed),
                MockGPTDataset(valid_samples, args.seq_length, args.vocab_size, args.seed + 1))
    from megazero.data import build_tokenizer, build_train_valid_test_datasets
    tokenizer = build_tokenizer(args)
    set_padded_vocab_size(args, tokenizer.vocab_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    train, valid, _ = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed, (train_samples, valid_samples, 0),
        cache_dir=args.data_cache_path, is_builder=rank == 0,
        barrier=dist.barrier if dist.is_initialized() else None)
    if train is None:
        raise ValueError(f"--split {args.split!r} leaves no training documents in --data-path {args.data_path}")
    return train, valid


def micro_batch_iterator(dataset, consumed_samples: int, args, topo: Topology, device, cycle: bool = False):
    """Yield this DP rank's micro-batches (dicts of tensors on ``device``) from ``consumed_samples`` on."""
    from megazero.data.samplers import PretrainingSampler, collate, get_tokens_and_labels
    position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(args.micro_batch_size, -1)
    start = consumed_samples
    while True:
        sampler = PretrainingSampler(len(dataset), start, args.micro_batch_size, topo.dp_rank, topo.dp)
        for indices in sampler:
            tokens, labels = (t.to(device) for t in get_tokens_and_labels(collate([dataset[i] for i in indices])))
            yield {"tokens": tokens, "labels": labels, "position_ids": position_ids,
                   "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
        if not cycle:
            raise RuntimeError(f"ran out of training samples ({len(dataset)})")
        start = 0


def gpt_model_provider(args, topo: Topology) -> list:
    """This rank's VP GPT chunks (Megatron's interleaved layer assignment)."""
    from megazero.model import GPTConfig
    from megazero.pipeline import build_model_chunks
    return build_model_chunks(GPTConfig.from_args(args), topo)


def build_model_and_optimizer(args, topo: Topology, device, model_provider=None):
    """Model chunks for this rank (VP of them, from ``model_provider(args, topo)``) and the ZeRO
    optimizer over them."""
    from megazero.zero import ZeroOptimizer
    chunks = (model_provider or gpt_model_provider)(args, topo)
    chunks = [c.to(device) for c in chunks]
    optimizer = ZeroOptimizer.from_args(args, chunks, topo)
    return chunks, optimizer


def run_schedule(args, chunks, micro_batches, topo: Topology, grad_scale=1.0, forward_only: bool = False,
                 trace=None, forward_step_func=None):
    """One pass of the selected pipeline schedule over ``micro_batches``; the last stage's losses.

    ``forward_step_func(chunk, micro_batch, input_tensor)`` defaults to the GPT one (mean loss
    over the micro-batch's unmasked tokens on the last stage)."""
    from megazero.pipeline import forward_backward
    from megazero.pipeline.chunks import gpt_forward_step
    from megazero.pipeline.p2p import pipeline_tensor_shape
    shape = pipeline_tensor_shape(args.seq_length, args.micro_batch_size, args.hidden_size,
                                  args.tensor_model_parallel_size, args.sequence_parallel)
    return forward_backward(chunks, micro_batches, topo, forward_step_func or gpt_forward_step, shape,
                            args.params_dtype,
                            grad_scale=grad_scale, forward_only=forward_only, trace=trace)


def rng_state(chunks) -> dict:
    """Every RNG this rank draws from, as tensors and plain values (``weights_only``-loadable)."""
    np_state = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
             "torch": torch.get_rng_state(),
             "trackers": [c.rng.state_dict() for c in chunks]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, chunks) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for chunk, tracker_state in zip(chunks, state["trackers"]):
        chunk.rng.load_state_dict(tracker_state)
