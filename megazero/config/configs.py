"""The typed, frozen configs a run reads: one object per concern, built once from the flags.

:func:`megazero.config.run_config.run_config` is their one builder (from ``parse_args``'
namespace); nothing downstream reads the argument namespace. Each field's docstring names the
flag it comes from (Megatron-LM's name) and what it means. The model's config is
:class:`megazero.model.config.GPTConfig`, the ZeRO optimizer's :class:`.optimizer.OptimizerConfig`,
the tokenizer's :class:`megazero.data.tokenizers.TokenizerConfig`; the LR schedule's and the
batch schedule's are here and in :mod:`.batch_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from megazero.config.batch_schedule import BatchSchedule
from megazero.config.optimizer import OptimizerConfig
from megazero.data.tokenizers import TokenizerConfig
from megazero.model.config import GPTConfig


@dataclass(frozen=True)
class ParallelConfig:
    """The rank grid, in Megatron's order tp-cp-ep-dp-pp (TP fastest): ``world = TP x CP x DP x PP``;
    the expert layers' grid (``ETP x EP x EDP x PP``) factors the same ranks, experts carved out of
    ``TP x CP x DP`` (:mod:`megazero.parallel.topology`)."""

    world_size: int
    """Ranks in the run (``WORLD_SIZE`` / ``SLURM_NTASKS``)."""
    tp: int = 1
    """``--tensor-model-parallel-size``."""
    pp: int = 1
    """``--pipeline-model-parallel-size``."""
    vp: int | None = None
    """Virtual stages per pipeline rank (``num_layers / (PP x --num-layers-per-virtual-pipeline-stage)``);
    None when not interleaved."""
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``; refused above 1 until it lands)."""
    ep: int = 1
    """``--expert-model-parallel-size``: ranks an MoE layer's experts are spread over (EP), carved
    out of each pipeline stage's ``TP x CP x DP`` ranks; ``ETP x EP`` divides them."""
    etp: int = 1
    """``--expert-tensor-parallel-size``: ranks each expert's weights are split over (ETP);
    resolved, ``--tensor-model-parallel-size`` when not given (Megatron's default)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations outside TP regions split over TP along the sequence."""
    backend: str = "gloo"
    """``--distributed-backend`` (default nccl with CUDA, gloo otherwise)."""
    timeout_minutes: float = 10.0
    """``--distributed-timeout-minutes``: bounds every collective of every group."""
    pipeline_schedule: str | None = None
    """``--pipeline-schedule`` (megazero's own; None: ``1f1b``, or ``interleaved-1f1b`` with VP > 1)."""

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world / (TP x CP x PP)``."""
        return self.world_size // (self.tp * self.cp * self.pp)


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how a micro-batch is cut from them (Megatron's data flags)."""

    seq_length: int
    """``--seq-length``: tokens per sample (the sample holds one more, for the labels)."""
    micro_batch_size: int
    """``--micro-batch-size``: samples per micro-batch per data-parallel rank."""
    tokenizer: TokenizerConfig
    """``--tokenizer-type`` and its files (``--tokenizer-model``, ``--vocab-file``, ``--merge-file``)."""
    data_path: tuple[str, ...] | None = None
    """``--data-path``: a prefix, or ``weight prefix weight prefix ...`` (a blend)."""
    split: str = "969, 30, 1"
    """``--split``: train, valid, test shares of ``--data-path``'s documents."""
    per_split_paths: tuple[tuple[str, ...] | None, ...] | None = None
    """``(--train-data-path, --valid-data-path, --test-data-path)`` when any is given."""
    mock: bool = False
    """``--mock-data`` (or no data path at all): uniformly random tokens."""
    vocab_size: int | None = None
    """``--vocab-size``: the vocabulary of mock data and NullTokenizer."""
    cache_path: str | None = None
    """``--data-cache-path``: where the index caches are built (default beside the data)."""
    seed: int = 1234
    """``--seed``: the samples' shuffle and mock tokens."""
    num_workers: int = 2
    """``--num-workers``: 0 reads micro-batches on the main thread, >= 1 on one reader thread."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: no loss on the prediction after an end-of-document token."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: positions restart after each end-of-document token."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: attention stays within a document."""


@dataclass(frozen=True)
class LRConfig:
    """The learning-rate schedule: Megatron's (in samples) or a DeepSpeed config's scheduler block."""

    lr: float | None
    """``--lr``: the peak learning rate."""
    min_lr: float = 0.0
    """``--min-lr``: the floor after decay."""
    decay_style: str = "linear"
    """``--lr-decay-style``: constant, linear or cosine."""
    warmup_samples: float = 0.0
    """Warm-up length in samples (``--lr-warmup-iters x B``, ``--lr-warmup-samples``, or the
    ``--lr-warmup-fraction`` of the decay)."""
    decay_samples: float = 0.0
    """Decay length in samples (``--lr-decay-iters x B``, default ``--train-iters``, or
    ``--lr-decay-samples``, default ``--train-samples``)."""
    warmup_init: float = 0.0
    """``--lr-warmup-init``: the LR at the start of warm-up."""
    samples_per_step: int = 1
    """``--global-batch-size``: the unit of the iteration-based lengths."""
    override: bool = False
    """``--override-opt_param-scheduler``: the flags win over the checkpoint's settings."""
    use_checkpoint: bool = False
    """``--use-checkpoint-opt_param-scheduler``: the checkpoint's settings win."""
    decoupled_lr: float | None = None
    """``--decoupled-lr``: peak LR of the embedding and output layer (None: the same LR)."""
    decoupled_min_lr: float | None = None
    """``--decoupled-min-lr``: their floor (default ``--min-lr``)."""
    deepspeed_scheduler: Mapping | None = None
    """A ``--deepspeed-config`` scheduler block, as ``DeepSpeedLRScheduler``'s keywords."""


@dataclass(frozen=True)
class ScheduleConfig:
    """How long the run trains and evaluates, in what batches, and when it stops early."""

    train_iters: int
    """``--train-iters`` (derived from ``--train-samples`` when that is given)."""
    batches: BatchSchedule
    """The global batch size by consumed samples (constant, ``--step-batch-size-schedule`` or
    ``--rampup-batch-size``)."""
    global_batch_size: int
    """``--global-batch-size``: the evaluation batch and the unit of iteration-based LR lengths."""
    num_micro_batches: int
    """``global_batch / (micro_batch x DP)``: micro-batches per evaluation step."""
    lr: LRConfig
    """The learning-rate schedule."""
    train_samples: int | None = None
    """``--train-samples``: a sample-based run's length."""
    eval_iters: int = 100
    """``--eval-iters``: global batches per evaluation."""
    eval_interval: int | None = 1000
    """``--eval-interval``: iterations between evaluations."""
    exit_interval: int | None = None
    """``--exit-interval``: exit after the iteration divisible by it."""
    exit_duration_in_mins: float | None = None
    """``--exit-duration-in-mins``: save and exit once the run has lasted this long."""
    exit_signal_handler: bool = False
    """``--exit-signal-handler``: on SIGTERM/SIGUSR1 (and ``--exit-signal``), save and exit 0."""
    exit_signal: str = "SIGTERM"
    """``--exit-signal``: also trapped by the handler (a signal name)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from, and what they hold."""

    save: str | None = None
    """``--save``: the folder to save to."""
    load: str | None = None
    """``--load``: the folder to resume or start from."""
    save_interval: int | None = None
    """``--save-interval``: iterations between saves."""
    async_save: bool = False
    """``--async-save``: written by a writer process per rank while training goes on."""
    save_optim: bool = True
    """Not ``--no-save-optim``: the fp32 master weights and Adam moments are saved."""
    save_rng: bool = True
    """Not ``--no-save-rng``."""
    load_optim: bool = True
    """Not ``--no-load-optim``."""
    load_rng: bool = True
    """Not ``--no-load-rng``."""
    finetune: bool = False
    """``--finetune``: load the weights only and start at iteration 0."""
    exit_on_missing_checkpoint: bool = False
    """``--exit-on-missing-checkpoint``: no checkpoint in ``--load`` exits instead of starting anew."""
    overwrite: bool = False
    """``--overwrite-checkpoints``: ``--save`` may hold another run's checkpoints."""
    ckpt_format: str = "torch_dist"
    """``--ckpt-format``: ``torch_dist`` / ``torch`` megazero's format, ``torch_dcp`` a PyTorch DCP
    folder (:mod:`megazero.checkpoint.dcp`). ``--load`` reads either, whatever this says."""


@dataclass(frozen=True)
class WandbConfig:
    """Megatron's W&B writer (``--wandb-*``); inactive without a project."""

    project: str | None = None
    """``--wandb-project``."""
    exp_name: str | None = None
    """``--wandb-exp-name``: the run's name."""
    save_dir: str | None = None
    """``--wandb-save-dir`` (default ``<--save>/wandb``)."""
    entity: str | None = None
    """``--wandb-entity``."""


@dataclass(frozen=True)
class LoggingConfig:
    """The log line, TensorBoard and W&B (Megatron's names)."""

    log_interval: int = 100
    """``--log-interval``: iterations per log line."""
    throughput: bool = False
    """``--log-throughput``: TFLOP/s per GPU in the log line."""
    params_norm: bool = False
    """``--log-params-norm``."""
    num_zeros_in_grad: bool = False
    """``--log-num-zeros-in-grad``."""
    tensorboard_dir: str | None = None
    """``--tensorboard-dir``."""
    tensorboard_log_interval: int = 1
    """``--tensorboard-log-interval``."""
    tensorboard_queue_size: int = 1000
    """``--tensorboard-queue-size``."""
    timers_to_tensorboard: bool = False
    """``--log-timers-to-tensorboard``: iteration time and throughput."""
    loss_scale_to_tensorboard: bool = True
    """Not ``--no-log-loss-scale-to-tensorboard``."""
    validation_ppl_to_tensorboard: bool = False
    """``--log-validation-ppl-to-tensorboard``."""
    memory_to_tensorboard: bool = False
    """``--log-memory-to-tensorboard``."""
    world_size_to_tensorboard: bool = False
    """``--log-world-size-to-tensorboard``."""
    pipeline_trace: str | None = None
    """``--pipeline-trace``: a Chrome-trace JSON of one step's pipeline schedule."""
    debug: bool = False
    """``--debug``: full tracebacks of failures."""
    wandb: WandbConfig = WandbConfig()
    """The W&B writer's settings."""


@dataclass(frozen=True)
class ReliabilityConfig:
    """Result checks, re-runs, fault injection and straggler reports (Megatron-LM's flags,
    docs/reliability.md; :mod:`megazero.training.rerun`, :mod:`megazero.training.stragglers`)."""

    rerun_mode: str = "validate_results"
    """``--rerun-mode``: validate_results (re-run a flagged iteration), report_stats, disabled."""
    check_nan: bool = True
    """Not ``--no-check-for-nan-in-loss-and-grad`` (and not fp16 with dynamic loss scaling)."""
    check_spiky_loss: bool = False
    """``--check-for-spiky-loss``: a micro-batch loss >= 10x the largest of the first 100."""
    check_large_grads: bool = False
    """``--check-for-large-grads``: a local bucket gradient norm >= 10x the largest of the first 100."""
    error_injection_rate: int = 0
    """``--error-injection-rate``: one injected unexpected result per N validations (0: none)."""
    error_injection_type: str = "transient_error"
    """``--error-injection-type``: correct_result, transient_error or persistent_error."""
    on_transient: str = "continue"
    """``--rerun-on-transient-error`` (megazero): continue, exit (17) or checkpoint_and_exit (16)."""
    log_straggler: bool = False
    """``--log-straggler``: the slowest and fastest ranks every ``--log-interval`` iterations."""
    straggler_port: int = 65535
    """``--straggler-ctrlr-port``: rank 0's toggle port."""
    straggler_minmax_count: int = 1
    """``--straggler-minmax-count``: lowest/highest estimated-throughput ranks listed."""
    straggler_on_startup: bool = True
    """Not ``--disable-straggler-on-startup``."""

    @property
    def any_check(self) -> bool:
        """Whether any result is checked each iteration (then its scalars join the packed all-reduce)."""
        return self.check_nan or self.check_spiky_loss or self.check_large_grads


@dataclass(frozen=True)
class RunConfig:
    """Everything one run reads, by concern; built once by ``run_config(args, vocab_size)``."""

    model: GPTConfig
    """The network (vocabulary from the tokenizer)."""
    parallel: ParallelConfig
    """The rank grid."""
    optimizer: OptimizerConfig
    """ZeRO stage, AdamW, clipping, loss scaling."""
    data: DataConfig
    """Datasets, tokenizer, micro-batches."""
    schedule: ScheduleConfig
    """Iterations, batch sizes, LR, evaluation, early exit."""
    checkpoint: CheckpointConfig
    """Saving and loading."""
    logging: LoggingConfig
    """Log line, TensorBoard, W&B."""
    seed: int = 1234
    """``--seed``: the host generators (``seed + 100 x pp_rank``) and the name-seeded weights."""
    attention_backend: str = "auto"
    """``--attention-backend`` (``--use-flash-attn``: flash): the SDPA kernel on CUDA."""
    gradient_accumulation_fusion: bool = True
    """Not ``--no-gradient-accumulation-fusion``: vocabulary weight gradients straight into fp32."""
    reliability: ReliabilityConfig = ReliabilityConfig()
    """NaN/spike/large-gradient checks, re-runs, fault injection, straggler reports."""
    host_memory_policy: str = "speed"
    """``--zero-host-memory-policy``: glibc's mmap threshold on the host (``speed`` or ``tight``;
    :func:`megazero.training.build.host_memory_plan`)."""
    flags: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """Every flag's value by Megatron's ``dest`` name (JSON-ready): what a checkpoint records as
    its ``args``, TensorBoard's ``arguments`` text and W&B's config."""
