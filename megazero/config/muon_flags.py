"""``--optimizer`` and the ``--muon-*`` flags, Megatron-LM's names and defaults (NVIDIA/Megatron-LM
``megatron/training/arguments.py`` at d98e8a6, 2026-08-22: ``_add_regularization_args`` and
``--optimizer``; the math is emerging_optimizers' ``TensorParallelMuon``, read through
``megatron/core/optimizer/emerging_optimizers.py``), and their checks.

Muon steps the 2-D hidden matrices; AdamW (``--adam-*``, ``--weight-decay``, the same LR schedule)
steps the embeddings, the output layer and every parameter that is not 2-D (Megatron's
``_is_nonlinear_or_embedding``). What is refused, one line each before any process group:
``--optimizer sgd/lion/soap/adaptive_muon``, ``--muon-tp-mode blockwise`` (Megatron's default) at TP > 1
(it orthogonalizes each TP shard on its own: the update depends on TP; at TP 1 it is the whole
matrix, so it is honoured there), ``--muon-scalar-optimizer lion``,
``--muon-use-syrk`` (a Triton kernel), ``--muon-coefficient-type custom/cubic5`` and unknown types,
``--muon-num-ns-steps`` < 1, ``--muon-fp32-matmul-prec low`` (torch has no such precision: Megatron
fails on it too), fp16 (Megatron's Muon runs bf16 or fp32 only) and ``--optimizer-cpu-offload``
(refused for every optimizer).
"""

from __future__ import annotations

import argparse

from megazero.config.deepspeed_muon import check_muon_config, check_muon_trainer

# megazero.optim.muon.COEFFICIENTS' names (the config package imports no optimizer code; a test keeps them equal)
COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")
OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")  # Megatron's choices


def add_muon_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer choice and Muon's settings (Megatron-LM's names and defaults)."""
    g = p.add_argument_group("optimizer (Muon: docs/muon.md)")
    g.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="adam (AdamW: --adam-*) or muon (2-D hidden matrices; AdamW for the rest)")
    g.add_argument("--muon-momentum", type=float, default=0.9)
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv", default=True,
                   help="orthogonalize the QKV matrix whole instead of Q, K and V apart")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum")
    g.add_argument("--muon-scale-mode", default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"])
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=["low", "medium", "high"],
                   help="medium: Newton-Schulz in bf16; high: in fp32")
    g.add_argument("--muon-coefficient-type", default="quintic")
    g.add_argument("--muon-num-ns-steps", type=int, default=5)
    g.add_argument("--muon-tp-mode", default="blockwise", choices=["blockwise", "duplicated", "distributed"],
                   help="duplicated/distributed: the whole matrix is orthogonalized (exact); blockwise "
                        "(Megatron's default): each TP shard alone, refused at TP > 1")
    g.add_argument("--muon-use-syrk", action="store_true")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0)
    g.add_argument("--muon-scalar-optimizer", default="adam", choices=["adam", "lion"])


def check_muon(fail, args) -> None:
    """One line per Muon setting megazero cannot honour (module docstring); a DeepSpeed config's
    Muon block: :mod:`.deepspeed_muon`'s checks."""
    if getattr(args, "muon_halves", None) is not None:
        check_muon_config(fail, args)
        check_muon_trainer(fail, args)
        return
    opt = getattr(args, "optimizer", "adam")
    if opt in ("sgd", "lion", "soap", "adaptive_muon"):
        fail(f"--optimizer {opt} is not available in megazero; use adam or muon")
    if opt == "dist_muon":
        fail("--optimizer dist_muon is deprecated in Megatron-LM; use --optimizer muon --use-distributed-optimizer")
    if opt != "muon":
        return
    if args.muon_num_ns_steps < 1:
        fail(f"--muon-num-ns-steps must be at least 1, got {args.muon_num_ns_steps}")
    if args.muon_coefficient_type not in COEFFICIENT_TYPES:
        fail(f"--muon-coefficient-type {args.muon_coefficient_type!r} is not available; one of "
             f"{', '.join(COEFFICIENT_TYPES)}")
    tp = max(args.tensor_model_parallel_size or 1, getattr(args, "expert_tensor_parallel_size", None) or 1)
    if args.muon_tp_mode == "blockwise" and tp > 1:  # at TP 1 every shard is the whole matrix: the same math
        fail(f"--muon-tp-mode blockwise (Megatron's default) at tensor-parallel size {tp} orthogonalizes each TP "
             "shard alone, so the update depends on TP; megazero orthogonalizes whole matrices: pass "
             "--muon-tp-mode duplicated (or distributed)")
    if args.muon_fp32_matmul_prec == "low":
        fail("--muon-fp32-matmul-prec low is not a torch matmul precision; use medium (bf16) or high (fp32)")
    if args.muon_use_syrk:
        fail("--muon-use-syrk (a Triton kernel) is not available; drop it (same math)")
    if args.muon_scalar_optimizer != "adam":
        fail(f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not available; use adam")
    if getattr(args, "fp16", False):
        fail("--optimizer muon with --fp16 is not available (Megatron's Muon takes bf16 or fp32); use --bf16")
    if not 0.0 <= args.muon_momentum < 1.0:
        fail(f"--muon-momentum must be in [0, 1), got {args.muon_momentum}")
