"""Multi-token prediction on the command line: Megatron-LM's ``--mtp-num-layers`` and
``--mtp-loss-scaling-factor`` (megatron-core 0.16.1 ``TransformerConfig.mtp_num_layers`` /
``mtp_loss_scaling_factor``, default 0.1; :mod:`megazero.model.mtp`) and the layouts that can
place the MTP layers, each refused in one line before any process group:

* learned absolute positions: Megatron-LM's ``validate_args`` (megatron/training/arguments.py,
  core_v0.16.x) allows MTP with ``--position-embedding-type rope`` (or none) only;
* context parallelism: the shifts of tokens, labels and mask cross CP ranks (Megatron's
  ``roll_tensor`` exchanges the boundary) -- not here: ``--context-parallel-size 1``;
* ``--calculate-per-token-loss``: Megatron then weighs each depth's loss *sum* by the LM loss's
  token count (``MTPLossAutoScaler`` without ``/ num_tokens``), not each depth's own mean;
* a pipeline (PP > 1) with tied embeddings: the last stage holds a copy of the word embedding
  (synced with the first stage's), which here is only possible for an untied output layer (the
  tied output layer already is that stage's copy);
* ``--recompute-granularity full`` with the uniform method (or none) and ``--recompute-num-layers``
  > 1: megatron-core 0.16.1 recomputes each MTP layer on its own and asserts
  ``recompute_num_layers == 1`` (``MultiTokenPredictionLayer._checkpointed_forward``). With
  ``--recompute-method block`` the MTP layers are not recomputed (a warning, one line per job;
  Megatron warns in the forward); see :mod:`megazero.model.mtp`.

``--mtp-standalone``, ``--mtp-use-repeated-layer``, ``--mtp-detach-heads`` and
``--mtp-hybrid-override-pattern`` stay refused (megatron_flags.tsv).
"""

from __future__ import annotations

import argparse
import warnings

from megazero.model.mtp import MTP_BLOCK_NOTICE, mtp_recompute_problem


def add_mtp_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="D extra layers on the last stage predicting tokens t+2..t+D+1 (DeepSeek-V3's MTP)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="c: (c / D) x the sum of the D MTP losses joins the LM loss's gradient")


def check_mtp(err, args) -> None:
    """The checks of the module doc."""
    D = getattr(args, "mtp_num_layers", None)
    if D is None:
        return
    if D < 1:
        err(f"--mtp-num-layers {D} must be >= 1 (omit it for no multi-token prediction)")
        return
    cp, pp = getattr(args, "context_parallel_size", 1) or 1, args.pipeline_model_parallel_size or 1
    if cp > 1:
        err(f"--mtp-num-layers {D} with --context-parallel-size {cp}: the MTP shifts of tokens, labels and loss "
            "mask across CP ranks are not available; use --context-parallel-size 1")
    if getattr(args, "calculate_per_token_loss", False):
        err(f"--mtp-num-layers {D} with --calculate-per-token-loss: Megatron then scales each MTP loss sum by the "
            "LM loss's token count, which is not available here; drop --calculate-per-token-loss (the same LM loss "
            "here: every micro-batch has the same token count)")
    if pp > 1 and not args.untie_embeddings_and_output_weights:
        err(f"--mtp-num-layers {D} with --pipeline-model-parallel-size {pp} needs "
            "--untie-embeddings-and-output-weights: the last stage's MTP embedding is a copy of the first "
            "stage's, available here for an untied output layer only")
    schedule = getattr(args, "pipeline_schedule", None)
    if schedule in ("zbv", "dualpipev"):
        err(f"--mtp-num-layers {D} with --pipeline-schedule {schedule}: the V placement puts the last stage on "
            "pipeline rank 0 beside the embedding, and MTP's embedding copy is not placed for it; use "
            "--pipeline-schedule 1f1b, interleaved-1f1b, zb-h1 or interleaved-zb")
    method, n = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    if getattr(args, "recompute_granularity", None) == "full" and method != "block" and n not in (None, 1):
        err(mtp_recompute_problem(D, method, n))
    if getattr(args, "recompute_granularity", None) == "full" and method == "block":
        warnings.warn(MTP_BLOCK_NOTICE, stacklevel=3)
    if args.position_embedding_type != "rope":
        err(f"--mtp-num-layers {D} needs --position-embedding-type rope (got {args.position_embedding_type}), as in "
            "Megatron-LM")
