"""The ZeRO optimizer's config: its hyper-parameters by the keyword names of
:class:`megazero.zero.ZeroOptimizer` (``ZeroOptimizer(chunks, topo, **cfg.kwargs(), ...)``), from
the validated flags (Megatron-LM's names; a ``--deepspeed-config``'s keys already merged). One of
the run's configs (:class:`megazero.config.configs.RunConfig`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class OptimizerConfig:
    """ZeRO stage, AdamW, clipping and loss scaling; the fields are ZeroOptimizer's keywords.

    ``loss_scale`` set: a constant scale (fp16 with ``--loss-scale``); ``dynamic_loss_scale``:
    fp16 without one. bf16 accumulates gradients in fp32 (``accumulate_in_fp32``).
    """

    stage: int
    num_micro_batches: int
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip_grad: float
    params_dtype: torch.dtype
    accumulate_in_fp32: bool
    loss_scale: float | None
    dynamic_loss_scale: bool
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int
    reduce_bucket_size: int
    overlap_comm: bool
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    decoupled_weight_decay: bool = True
    overlap_param_gather: bool = False
    muon: dict | None = None  # --optimizer muon: megazero.optim.muon.MuonSettings' fields (not a ZeroOptimizer keyword)

    @classmethod
    def from_args(cls, args) -> "OptimizerConfig":
        """From ``parse_args``' namespace (Megatron flag names; DeepSpeed keys already merged)."""
        return cls(stage=args.zero_stage, num_micro_batches=args.num_micro_batches, lr=args.lr,
                   weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                   clip_grad=args.clip_grad, decoupled_weight_decay=bool(args.adam_w_mode),
                   params_dtype=args.params_dtype,
                   accumulate_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
                   loss_scale=args.loss_scale if args.fp16 and args.loss_scale else None,
                   dynamic_loss_scale=bool(args.fp16 and not args.loss_scale),
                   initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                   loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                   reduce_bucket_size=args.zero_reduce_bucket_size, overlap_comm=args.zero_overlap_comm,
                   overlap_param_gather=bool(getattr(args, "overlap_param_gather", False) or args.zero_overlap_comm),
                   prefetch_bucket_size=args.zero_prefetch_bucket_size,
                   param_persistence_threshold=args.zero_param_persistence_threshold,
                   max_live_parameters=args.zero_max_live_parameters,
                   max_reuse_distance=args.zero_max_reuse_distance, muon=muon_settings(args))

    def kwargs(self) -> dict:
        """The keyword arguments of ``ZeroOptimizer``."""
        kw = asdict(self)
        kw.pop("muon")
        return kw


def muon_settings(args) -> dict | None:
    """``--optimizer muon``'s ``MuonSettings`` fields from Megatron's ``--muon-*`` flags (the
    ``megatron`` Newton-Schulz flavour; ``--muon-fp32-matmul-prec medium`` runs it in bf16, ``high``
    in fp32); None for AdamW. A DeepSpeed config's Muon block sets ``args.muon_settings`` itself."""
    given = getattr(args, "muon_settings", None)
    if given is not None:
        return dict(given)
    if getattr(args, "optimizer", "adam") != "muon":
        return None
    return dict(momentum=args.muon_momentum, nesterov=bool(args.muon_nesterov), ns_steps=args.muon_num_ns_steps,
                coefficient_type=args.muon_coefficient_type, flavour="megatron",
                ns_dtype=torch.bfloat16 if args.muon_fp32_matmul_prec == "medium" else torch.float32,
                scale_mode=args.muon_scale_mode, extra_scale=args.muon_extra_scale_factor,
                split_qkv=bool(args.muon_split_qkv), decoupled=bool(args.adam_w_mode))
