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


def _writer_shims() -> None:
    """See the module doc; in a forked rank only."""
    import multiprocessing
    import queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    multiprocessing.current_process()._config["daemon"] = False
    filesystem_async._results_queue = queue.Queue()
    torch.cuda.synchronize = lambda *a, **k: None


def megatron_dist_rank(rank: int, world: int, model: dict, tp: int, pp: int, vp, root: str, iteration: int = 7):
    """One gloo rank: build the chunks (megatron_helpers' weights), save torch_dist, return the
    logits of ``mh.batch`` on the last stage's TP rank 0 (else None)."""
    mh.cpu_shims()
    _writer_shims()
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


def moe_args(tp: int, ep: int):
    """A Llama-style MoE run's ``args`` (2 layers, 4 experts of FFN 24, top-2, every layer MoE)."""
    a = mh.megatron_args(dict(mh.LLAMA, num_layers=2), tp, 1, None)
    return type(a)(**{**vars(a), "num_experts": 4, "moe_ffn_hidden_size": 24, "moe_router_topk": 2,
                      "expert_model_parallel_size": ep, "moe_grouped_gemm": False,
                      "moe_token_dispatcher_type": "allgather"})


def build_moe(a):
    """megatron-core's MoE GPTModel (local spec, ``SequentialMLP``, the allgather dispatcher: the
    alltoall one makes CUDA streams), every parameter redrawn: a routed expert's by its name and
    EP rank (the local expert ``k`` of EP rank ``r`` is expert ``r E/EP + k``), the rest by name."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.Generator().manual_seed(1).get_state(),
                                       "expert-parallel-rng": torch.Generator().manual_seed(2).get_state()})
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, num_query_groups=a.num_query_groups, normalization=a.normalization,
        add_bias_linear=False, activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=False,
        tensor_model_parallel_size=a.tensor_model_parallel_size, expert_model_parallel_size=a.expert_model_parallel_size,
        num_moe_experts=a.num_experts, moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_topk=a.moe_router_topk,
        moe_token_dispatcher_type=a.moe_token_dispatcher_type, use_cpu_initialization=True, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=a.num_experts, moe_grouped_gemm=False,
                                                   normalization=a.normalization),
                     a.padded_vocab_size, a.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=a.rotary_base, share_embeddings_and_output_weights=False, parallel_output=False)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            shard = tp_rank if getattr(p, "tensor_model_parallel", False) else -1
            owner = ep_rank if ".experts." in name else -1
            g = torch.Generator().manual_seed(mh.hash_name(f"{name}/{shard}/{owner}"))
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def megatron_moe_dist_rank(rank: int, world: int, tp: int, ep: int, root: str, iteration: int = 7):
    """One gloo rank of a TP x EP MoE run: save torch_dist, return the logits on rank 0. Besides the
    shims above: ``moe_utils.te_general_gemm`` is left undefined when Transformer Engine is absent
    (a ``NameError`` in the router's gating), so it is set to None, taking its plain ``torch.mm``."""
    mh.cpu_shims()
    _writer_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    try:
        a = moe_args(tp, ep)
        model = build_moe(a)
        save_dist(root, a, [model], iteration)
        ids, pos, mask, _ = mh.batch(a)
        with torch.no_grad():
            out = model(ids, pos, mask)
        return out if rank == 0 else None
    finally:
        ps.destroy_model_parallel()
