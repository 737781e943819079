"""megatron-core 0.16.1 writing a ``--ckpt-format torch_dist`` checkpoint on CPU/gloo.

Real: ``GPTModel.sharded_state_dict`` (the ShardedTensor keys, the stacked layer axis, TP
offsets, the SwiGLU fc1 factory), ``megatron.core.dist_checkpointing.save`` with its default
``torch_dist`` strategy (``.metadata``, ``__R_0.distcp``, ``common.pt``, ``metadata.json``).
Reconstructed from Megatron-LM ``core_v0.16.1`` ``megatron/training/checkpointing.py``
(``save_checkpoint``: ``iter_NNNNNNN/`` as the checkpoint folder, ``generate_state_dict``'s
``args`` / ``checkpoint_version`` / ``iteration`` / ``model`` / ``model0..``, the content
metadata of ``_build_sharded_state_dict_metadata``: ``singleton_local_shards`` False) and the
tracker; no optimizer (``--no-save-optim``) and no RNG. CPU shims: tests/peers/megatron_helpers.py,
plus one here: the forked test rank is a daemon process, and megatron-core's writer starts
processes (a ``spawn`` Manager for the results queue, ``fork`` workers per file), which Python
refuses in a daemon; the rank clears its own daemon flag (it dies with the test anyway) and
the results queue is a plain ``queue.Queue`` (only this process reads and writes it; a spawned
Manager hangs under the test's forked ranks); ``torch.cuda.synchronize`` (called after the
device-to-host copy) does nothing.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.peers import megatron_helpers as mh

CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


def save_dist(root: str, a, chunks: list, iteration: int) -> None:
    """Megatron-LM's torch_dist save of the model chunks (collective over every rank)."""
    from megatron.core import dist_checkpointing
    folder = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    a = type(a)(**{**vars(a), "ckpt_format": "torch_dist"})
    state = {"args": a, "checkpoint_version": 3.0, "iteration": iteration}
    for c, model in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{c}"] = model.sharded_state_dict(metadata=CONTENT_METADATA)
    dist_checkpointing.save(state, folder, content_metadata=dict(CONTENT_METADATA))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    dist.barrier()


def megatron_dist_rank(rank: int, world: int, model: dict, tp: int, pp: int, vp, root: str, iteration: int = 7):
    """One gloo rank: build the chunks (megatron_helpers' weights), save torch_dist, return the
    logits of ``mh.batch`` on the last stage's TP rank 0 (else None)."""
    mh.cpu_shims()
    import multiprocessing
    import queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    multiprocessing.current_process()._config["daemon"] = False  # see the module doc
    filesystem_async._results_queue = queue.Queue()
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    try:
        a = mh.megatron_args(model, tp, pp, vp)
        chunks = mh.build_chunks(a, ps.get_pipeline_model_parallel_rank())
        save_dist(root, a, chunks, iteration)
        ids, pos, mask, _ = mh.batch(a)
        with torch.no_grad():
            out = mh.pipeline_logits(chunks, a, ids, pos, mask)
        return out if out is not None and ps.get_tensor_model_parallel_rank() == 0 else None
    finally:
        ps.destroy_model_parallel()
