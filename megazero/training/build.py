"""The build order of a run, stated once (:func:`setup`), with the reason for each step.

0. **Host memory** (after the configs, which allocate nothing large): at ZeRO stage 3 glibc's
   mmap threshold is fixed at 1 MiB (:func:`~megazero.zero.host_memory.return_freed_memory`)
   before anything large is allocated, and raised to the smallest unit's gathered bytes once
   the units exist (:func:`~megazero.zero.host_memory.unit_threshold`, step 7), so the unit
   buffers stage 3 gathers and frees every micro-batch leave the resident set instead of
   staying in the heap (ZeRO-3, DP 4: step peak 2.30 -> 1.75 GB) while smaller activations are
   reused from the heap. Stages 0-2 keep glibc's own policy, as every PyTorch program does: their
   large buffers live for the whole run, and a fixed threshold would make each activation of
   1 MiB or more a fresh mapping whose pages fault in on every micro-batch (measured: 39 k page
   faults and +12 % time per iteration at ZeRO-0 on the issue-33 GPT at world 1,
   docs/benchmarks.md, "The iteration as a user sees it"). That is ``--zero-host-memory-policy
   speed`` (the default); ``tight`` fixes 1 MiB before the build at every stage and never raises
   it (:func:`host_memory_plan`). Process-wide; a no-op off glibc; ``setup(...,
   fix_mmap_threshold=True/False)`` forces 1 MiB / glibc's policy before the build.
1. **Configs** (no process group yet, :func:`build_configs`, the only reader of the argument
   namespace outside :mod:`megazero.config`): the tokenizer gives the vocabulary size, which
   completes the frozen model config (:class:`GPTConfig` pads the vocabulary for TP and checks
   every size against TP), and one frozen config per concern (:class:`RunConfig`). Bad flags
   and unreadable tokenizer files fail here, before any rank waits on another; so does a
   ``--save`` folder that would lose a checkpoint (:func:`guard_save_dir`), and the LR schedule
   is built (it needs no group).
2. **Launch**: join torch.distributed (torchrun, SLURM or one process); the device follows the
   backend.
3. **Topology**: the TP x CP x PP x DP process groups (Megatron's order tp-cp-ep-dp-pp), created
   once and passed to everything below.
4. **Seeds**: ``seed + 100 * pp_rank`` for Python's ``random``, numpy and torch, as Megatron-LM's
   ``_set_random_seed`` (megatron/training/initialize.py @00c2c0ad; per-stage dropout streams).
   Parameter values never depend on them (each weight is drawn from its own name-seeded
   generator), so every layout starts from the same model.
5. **Datasets**: collective (rank 0 builds the index caches, the others wait), so after the groups.
6. **Model**: ``model_provider(model_config, topo, micro_batch_size[, device])`` returns this
   rank's :class:`ModelStages` (its pipeline chunks, the plain objects the generic packages need
   and the model's glue with the loop); a provider that takes ``device`` builds on the meta
   device and ZeRO materializes it (:func:`provider_options`), any other is moved to the device.
7. **Optimizer**: ZeRO flattens the parameters into its regions (and under stage 3 shards them),
   so it comes after the model exists and before anything holds parameter references; then the
   model's vocabulary matrices are told to accumulate their weight gradients into ZeRO's fp32
   flat gradient (``ModelStages.fuse_vocab_grads``; ``--no-gradient-accumulation-fusion``, Megatron's
   switch, skips it: the gradient is then computed in the parameter dtype and added, as Megatron
   does), and the ``--decoupled-lr`` parameters are named (``ModelStages.decoupled_lr_params``).
8. **Pipeline runner**: the schedule plan, the p2p communicator and the activation shape, built
   once for the run.
9. **Logger and Trainer**; then **load** ``--load`` last, because loading writes into the
   optimizer's master shards and the schedule's step count. A restarted attempt (torchrun,
   SLURM requeue) says which one it is and what it redoes (:mod:`megazero.training.restart`).
"""

from __future__ import annotations

import random
from datetime import timedelta

import numpy as np
import torch

from megazero.checkpoint.guard import guard_save_dir
from megazero.checkpoint import CheckpointError
from megazero.checkpoint.torch_dist import saved_args as latest_saved_args  # megazero's or Megatron's torch_dist
from megazero.checkpoint.reshard import model_mismatch_message
from megazero.config.configs import RunConfig
from megazero.config.run_config import data_config, run_config
from megazero.data.tokenizers import saved_tokenizer_flags
from megazero.model.saved_args import model_arg_diffs
from megazero.model.stages import ModelStages, gpt_stages, provider_options
from megazero.config.rank import current_rank
from megazero.parallel.launch import init_distributed
from megazero.parallel.topology import Topology
from megazero.training.data import build_datasets, vocab_size_of
from megazero.training.restart import resume_line
from megazero.zero.host_memory import return_freed_memory, unit_threshold


def seed_host_generators(seed: int) -> None:
    """Step 4: Python's ``random``, numpy's global generator and torch's default generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_configs(args) -> RunConfig:
    """Step 1: every frozen config of the run from ``parse_args``' namespace, before any process
    group. With ``--load`` and no ``--tokenizer-type``, the tokenizer the latest checkpoint there
    recorded (an imported model: ``convert_checkpoint.py from-hf`` records ``DIR/tokenizer``), so
    it trains and saves with its own tokenizer. The vocabulary size is the tokenizer's
    (``--vocab-size`` with mock data). A model-defining flag that differs from what that
    checkpoint recorded (:data:`~megazero.model.saved_args.MODEL_KEYS`) is refused here, naming
    every difference, before any work; so is a pipeline schedule whose plans the simulator rejects
    (:func:`megazero.pipeline.check_plans`)."""
    saved = latest_saved_args(args.load) if args.load else None
    if args.tokenizer_type is None and saved is not None:
        flags = saved_tokenizer_flags(saved, args.load)
        args = args.replace(**flags) if flags else args
    config = run_config(args, vocab_size=vocab_size_of(data_config(args)))
    diffs = model_arg_diffs(saved, config.model.to_args()) if saved else []
    if diffs:  # before any process group: every rank refuses alike
        raise CheckpointError(model_mismatch_message(f"--load {args.load}", diffs))
    par = config.parallel
    if par.pp > 1:  # every rank's pipeline plan through the simulator (deadlock, order, memory) before any group
        from megazero.pipeline import check_plans
        check_plans(par.pp, par.vp or 1, config.schedule.num_micro_batches, par.pipeline_schedule)
    return config


def host_memory_plan(config: RunConfig, fix_mmap_threshold: bool | None = None) -> tuple[bool, bool]:
    """Step 0: (fix glibc's mmap threshold at 1 MiB before the build, raise it to the smallest
    unit's gathered bytes once stage 3's units exist). ``--zero-host-memory-policy speed``: both
    at ZeRO stage 3, neither at stages 0-2 (glibc's own policy); ``tight``: 1 MiB at every stage,
    never raised, so every freed block of 1 MiB or more leaves the resident set (docs/zero.md, "Host
    memory on the CPU"). ``fix_mmap_threshold`` True/False (``setup``'s keyword, the benches')
    overrides the first; the second then follows the policy."""
    tight = config.host_memory_policy == "tight"
    fix = (tight or config.optimizer.stage == 3) if fix_mmap_threshold is None else fix_mmap_threshold
    return fix, fix and not tight


def build_model(config: RunConfig, topo: Topology, provider, device) -> ModelStages:
    """Step 6: this rank's stages; on the meta device when the provider can build there (ZeRO
    then materializes each unit on ``device``), else moved to ``device``."""
    stages = provider(config.model, topo, config.data.micro_batch_size, **provider_options(provider))
    for chunk in stages.chunks if stages.param_init is None else ():
        chunk.to(device)
    return stages


def print_parameter_count(topo: Topology, stages: ModelStages) -> None:
    """Megatron-LM's start-up line, one per (TP, PP) rank, printed by its DP x CP rank 0
    (megatron/training/training.py ``get_model``, core_v0.16.0): the elements of this rank's
    chunks' parameters (TP shards, padded vocabulary, a tied embedding's copy on the last
    stage included), counted before ZeRO flattens or shards them."""
    if topo.dp_cp_rank == 0:
        n = sum(p.nelement() for chunk in stages.chunks for p in chunk.parameters())
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({topo.tp_rank}, "
              f"{topo.pp_rank}): {n}", flush=True)


def attach_optimizer(config, topo, stages, optimizer) -> None:
    """What the model hands the optimizer beyond its parameters: the vocabulary layers' fused
    weight gradients (``--gradient-accumulation-fusion``), the ``--decoupled-lr`` parameters, and
    with ``--optimizer muon`` the 2-D hidden matrices Muon steps (training/muon_setup.py)."""
    if config.gradient_accumulation_fusion and optimizer.fuses_weight_grads and stages.fuse_vocab_grads:
        stages.fuse_vocab_grads(optimizer.add_weight_grad, optimizer.add_embedding_grad)
    if config.schedule.lr.decoupled_lr is not None:  # Megatron: the embedding and output layer on their own LR
        optimizer.set_decoupled_params(stages.decoupled_lr_params)
    if config.optimizer.muon is not None:
        from megazero.optim.muon import MuonSettings
        from megazero.training.muon_setup import muon_matrices
        settings = MuonSettings(**config.optimizer.muon)
        optimizer.set_muon(settings, muon_matrices(stages, topo, settings.split_qkv))


def setup(run, model_provider=None, forward_step_func=None, *, fix_mmap_threshold: bool | None = None):
    """Build everything one rank trains with, in the order of the module docstring; returns the
    :class:`~megazero.training.loop.Trainer`, with ``--load`` already loaded. ``run``: a
    :class:`RunConfig`, or ``parse_args``' namespace (built by :func:`build_configs`).
    ``model_provider`` (default the GPT's :func:`gpt_stages`) and ``forward_step_func``
    (default the stages' own) are Megatron's ``pretrain`` arguments."""
    from megazero.pipeline import PipelineRunner
    from megazero.training.logger import TensorBoardLogger, open_wandb
    from megazero.training.loop import Trainer
    from megazero.optim.lr_schedule import build_lr_scheduler
    from megazero.zero import ZeroOptimizer

    config = run if isinstance(run, RunConfig) else build_configs(run)                              # 1
    fix_threshold, raise_to_unit = host_memory_plan(config, fix_mmap_threshold)
    if fix_threshold:                                                                               # 0
        return_freed_memory()  # the build's freed blocks of >= 1 MiB leave the resident set (glibc)
    ck, par, log = config.checkpoint, config.parallel, config.logging
    guard_save_dir(ck.save, ck.load, ck.overwrite, current_rank(), finetune=ck.finetune)  # no checkpoint lost
    scheduler = build_lr_scheduler(config.schedule.lr)  # Megatron's schedule or a DeepSpeed config's block
    launch, device = init_distributed(par.backend, par.timeout_minutes)                              # 2
    if launch.world_size != par.world_size:
        raise RuntimeError(f"launched with {launch.world_size} ranks but the arguments were validated for "
                           f"{par.world_size}")
    topo = Topology(par.world_size, launch.rank, tp=par.tp, pp=par.pp, vp=par.vp or 1, cp=par.cp,    # 3
                    ep=par.ep, etp=par.etp, pipeline_schedule=par.pipeline_schedule,
                    ).create_groups(timeout=timedelta(minutes=par.timeout_minutes))  # no wait forever
    seed_host_generators(config.seed + 100 * topo.pp_rank)                                          # 4
    datasets = build_datasets(config.data, config.schedule, config.model.vocab_size)                 # 5
    stages = build_model(config, topo, model_provider or gpt_stages, device)                         # 6
    print_parameter_count(topo, stages)
    optimizer = ZeroOptimizer(stages.chunks, topo, **config.optimizer.kwargs(),                      # 7
                              shared_params=stages.shared_params,
                              tp_duplicated_params=stages.tp_duplicated_params,
                              expert_params=stages.expert_params, param_init=stages.param_init, device=device)
    if raise_to_unit and optimizer.gatherer is not None:  # from now on only unit-sized blocks are mapped
        return_freed_memory(unit_threshold(optimizer.gatherer.unit_bytes()))
    attach_optimizer(config, topo, stages, optimizer)
    runner = PipelineRunner(topo, config.schedule.num_micro_batches, stages.activation_shape,        # 8
                            stages.activation_dtype)
    tb = TensorBoardLogger(log.tensorboard_dir, enabled=launch.rank == par.world_size - 1,          # 9
                           max_queue=log.tensorboard_queue_size,
                           wandb=open_wandb(log.wandb, ck.save, config.flags, launch.rank, par.world_size))
    trainer = Trainer(config, topo, device, stages=stages, optimizer=optimizer, runner=runner,
                      forward_step=forward_step_func or stages.forward_step, datasets=datasets,
                      scheduler=scheduler, tb=tb)
    if launch.rank == 0:
        batches = trainer.batches
        m = ("from " if batches.varies else "") + str(batches.num_micro_batches(0))
        print(f"> {topo.describe()}; data-parallel size {topo.dp}, {m} micro-batches per step, "
              f"ZeRO stage {config.optimizer.stage}, params {config.optimizer.params_dtype}", flush=True)
    trainer.tb.text("arguments", "\n".join(f"    {k}: {v}" for k, v in sorted(config.flags.items())))
    if ck.load:
        trainer.load()
    resumed = launch.rank == 0 and not ck.finetune  # --finetune starts a new run at iteration 0
    line = resume_line(ck.load, trainer.iteration, trainer.consumed_samples) if resumed else None
    if line:  # a restarted attempt, or a record of the folder ahead of its checkpoint: what is redone
        print(line, flush=True)
    return trainer
