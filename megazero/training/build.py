"""The build order of a run, stated once (:func:`setup`), with the reason for each step.

0. **Host memory**: glibc's mmap threshold is fixed at 1 MiB
   (:func:`~megazero.zero.host_memory.return_freed_memory`) before anything large is allocated,
   so the host buffers ZeRO frees every micro-batch leave the resident set instead of staying in
   the heap (ZeRO-3, DP 4: step peak 2.30 -> 1.75 GB). Its price, measured by
   ``bench/memory.py --mmap-ab`` (fresh mappings fault their pages in): +0.7 % CPU time per
   iteration at ZeRO-0, +4.5 % at ZeRO-3 on a small fp32 GPT (docs/benchmarks.md, "Memory").
   Process-wide; a no-op off glibc; ``setup(..., fix_mmap_threshold=False)`` keeps glibc's policy.
1. **Configs** (no process group yet): the tokenizer gives the vocabulary size, which completes
   the frozen model config (:class:`GPTConfig` pads the vocabulary for TP and checks every size
   against TP), and the optimizer config. Bad flags and unreadable tokenizer files fail here,
   before any rank waits on another.
2. **Launch**: join torch.distributed (torchrun, SLURM or one process); the device follows the
   backend.
3. **Topology**: the TP x PP x DP process groups, created once and passed to everything below.
4. **Seeds**: ``seed + 100 * pp_rank`` for Python's ``random``, numpy and torch, as Megatron-LM's
   ``_set_random_seed`` (megatron/training/initialize.py @00c2c0ad; per-stage dropout streams).
   Parameter values never depend on them (each weight is drawn from its own name-seeded
   generator), so every layout starts from the same model.
5. **Datasets**: collective (rank 0 builds the index caches, the others wait), so after the groups.
6. **Model**: ``model_provider(model_config, topo, micro_batch_size)`` returns this rank's
   :class:`ModelStages` (its pipeline chunks and the plain objects the generic packages need),
   moved to the device.
7. **Optimizer**: ZeRO flattens the parameters into its regions (and under stage 3 shards them),
   so it comes after the model is on its device and before anything holds parameter references;
   then the output layer and the word embedding are told to accumulate their weight gradients
   into ZeRO's fp32 flat gradient (:func:`fuse_vocab_weight_grads`).
8. **Pipeline runner**: the schedule plan, the p2p communicator and the activation shape, built
   once for the run.
9. **LR schedule and logger**; then **load** ``--load`` last, because loading writes into the
   optimizer's master shards and the schedule's step count.
"""

from __future__ import annotations

import random
from datetime import timedelta

import numpy as np
import torch

from megazero.config import OptimizerConfig
from megazero.model.config import GPTConfig
from megazero.checkpoint.guard import guard_save_dir
from megazero.parallel.launch import current_rank, init_distributed
from megazero.parallel.topology import Topology
from megazero.training.data import build_datasets, vocab_size_of, with_checkpoint_tokenizer
from megazero.zero.host_memory import return_freed_memory


def seed_host_generators(seed: int) -> None:
    """Step 4: Python's ``random``, numpy's global generator and torch's default generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_configs(args) -> tuple[GPTConfig, OptimizerConfig]:
    """Step 1: the frozen model and optimizer configs (before any process group)."""
    model_config = GPTConfig.from_args(args, vocab_size=vocab_size_of(args))
    model_config.check_tp(args.tensor_model_parallel_size)
    return model_config, OptimizerConfig.from_args(args)


def default_model_provider(model_config: GPTConfig, topo: Topology, micro_batch_size: int, device=None):
    """The GPT: layers split over PP x VP in Megatron's interleaved order (``device="meta"``
    under ZeRO-3: nothing drawn until ZeRO materializes each unit into its shard)."""
    from megazero.model.stages import gpt_stages
    return gpt_stages(model_config, topo, micro_batch_size, device=device)


def fuse_vocab_weight_grads(chunks, optimizer) -> None:
    """Step 7, gradient accumulation fusion (Megatron's ``--gradient-accumulation-fusion``, on by
    default there): with half-precision parameters and fp32 gradient accumulation, each chunk's
    output layer adds its weight gradient ``G^T X``, and the word embedding its rows
    ``dW[ids] += G``, in fp32 straight into ZeRO's flat gradient
    (:mod:`megazero.tensor_parallel.wgrad_fusion`), so the vocabulary matrix (V x h, the largest
    weight, tied or not) never has a gradient of its size outside that buffer
    (docs/benchmarks.md, "Memory"). Chunks without these modules are left alone.
    ``--no-gradient-accumulation-fusion`` (Megatron's switch) skips this step: the gradient is
    computed in the parameter dtype first and then added to the fp32 flat gradient, as Megatron
    does then."""
    if not optimizer.fuses_weight_grads:
        return
    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if head is not None and hasattr(head, "accumulate_weight_grad_into"):
            head.accumulate_weight_grad_into(optimizer.add_weight_grad)
        table = getattr(getattr(chunk, "embedding", None), "word_embeddings", None)
        if table is not None and hasattr(table, "accumulate_weight_grad_into"):
            table.accumulate_weight_grad_into(optimizer.add_embedding_grad)


def setup(args, model_provider=None, forward_step_func=None, *, fix_mmap_threshold: bool = True):
    """Build everything one rank trains with, in the order of the module docstring; returns the
    :class:`~megazero.training.loop.Trainer`, with ``--load`` already loaded."""
    from megazero.model.stages import gpt_forward_step, provider_options
    from megazero.pipeline import PipelineRunner
    from megazero.training.logger import TensorBoardLogger, open_wandb
    from megazero.training.loop import Trainer
    from megazero.training.lr_schedule import build_lr_scheduler
    from megazero.zero import ZeroOptimizer

    if fix_mmap_threshold:  # 0: freed host buffers of >= 1 MiB leave the resident set (glibc)
        return_freed_memory()
    args = with_checkpoint_tokenizer(args)  # an imported model's own tokenizer when none is named
    model_config, optimizer_config = build_configs(args)                                             # 1
    guard_save_dir(args.save, args.load, getattr(args, "overwrite_checkpoints", False), current_rank())  # none lost
    scheduler = build_lr_scheduler(args)  # Megatron's schedule or a DeepSpeed config's scheduler block
    launch, device = init_distributed(args.distributed_backend, args.distributed_timeout_minutes)  # 2
    if launch.world_size != args.world_size:
        raise RuntimeError(f"launched with {launch.world_size} ranks but the arguments were validated for "
                           f"{args.world_size}")
    topo = Topology(args.world_size, launch.rank, tp=args.tensor_model_parallel_size,                 # 3
                    pp=args.pipeline_model_parallel_size,
                    vp=args.virtual_pipeline_model_parallel_size or 1).create_groups(
        timeout=timedelta(minutes=args.distributed_timeout_minutes))  # every group: no collective waits forever
    seed_host_generators(args.seed + 100 * topo.pp_rank)                                            # 4
    datasets = build_datasets(args, model_config.vocab_size)                                         # 5
    provider = model_provider or default_model_provider  # ZeRO-3: built on the meta device if it can  # 6
    stages = provider(model_config, topo, args.micro_batch_size, **provider_options(provider, args.zero_stage))
    for chunk in stages.chunks if stages.param_init is None else ():  # meta: ZeRO materializes on `device`
        chunk.to(device)
    optimizer = ZeroOptimizer(stages.chunks, topo, **optimizer_config.kwargs(),                      # 7
                              shared_params=stages.shared_params,
                              tp_duplicated_params=stages.tp_duplicated_params,
                              param_init=stages.param_init, device=device)
    if getattr(args, "gradient_accumulation_fusion", True):
        fuse_vocab_weight_grads(stages.chunks, optimizer)
    runner = PipelineRunner(topo, args.num_micro_batches, stages.activation_shape,                   # 8
                            stages.activation_dtype)
    trainer = Trainer(args, topo, device, model_config=model_config, stages=stages, optimizer=optimizer,  # 9
                      runner=runner, forward_step=forward_step_func or gpt_forward_step, datasets=datasets,
                      scheduler=scheduler,
                      tb=TensorBoardLogger(args.tensorboard_dir, enabled=launch.rank == args.world_size - 1,
                                           max_queue=getattr(args, "tensorboard_queue_size", 1000),
                                           wandb=open_wandb(args, launch.rank, args.world_size)))
    if launch.rank == 0:
        batches = trainer.batches
        m = ("from " if batches.varies else "") + str(batches.num_micro_batches(0))
        print(f"> {topo.describe()}; data-parallel size {topo.dp}, {m} micro-batches per step, "
              f"ZeRO stage {args.zero_stage}, params {args.params_dtype}", flush=True)
    trainer.tb.text("arguments", "\n".join(f"    {k}: {v}" for k, v in sorted(args.as_dict().items())))
    if args.load:
        trainer.load()
    return trainer

