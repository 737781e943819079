"""Context parallelism on the command line: Megatron-LM's ``--context-parallel-size`` and
``--cp-comm-type`` (core_v0.20.0 ``_add_distributed_args``: ``--context-parallel-size`` int,
default 1; ``--cp-comm-type`` a list, one type for all layers or one per layer, default
``['p2p']``) and their checks, all before any process group.

megazero has ``p2p`` (ring attention) and ``a2a`` (DeepSpeed-Ulysses all-to-all); Megatron's
``allgather`` and ``a2a+p2p`` (hierarchical, with ``--hierarchical-context-parallel-sizes``) are
named with what to use instead, as is a per-layer mix of types. The grid is
``world = TP x CP x DP x PP`` (Megatron's order tp-cp-ep-dp-pp); the data-parallel size excludes
CP (the global batch is ``micro-batch x DP x M``), while gradients are averaged and ZeRO
partitions over ``DP x CP``.
"""

from __future__ import annotations

CP_COMM_TYPES = ("p2p", "a2a")
NOT_AVAILABLE = {
    "allgather": "the all-gather KV exchange is not available; use p2p (the ring: same math, K/V "
                 "blocks passed around) or a2a",
    "a2a+p2p": "hierarchical a2a+p2p is not available; use p2p or a2a over the whole CP group",
}


def add_cp_flags(g) -> None:
    """``--context-parallel-size`` and ``--cp-comm-type`` in the distributed group."""
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks one sequence is split over (ring or all-to-all attention)")
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="attention across CP ranks: p2p (ring) or a2a (Ulysses); one for all layers")


def model_parallel_product(args) -> int:
    """``TP x PP x CP``: the ranks one data-parallel replica spans."""
    return (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            * getattr(args, "context_parallel_size", 1))


def check_cp(err, args) -> None:
    """Context parallelism's problems, each one ``err`` line (see the module docstring)."""
    cp = args.context_parallel_size
    if cp < 1:
        err(f"--context-parallel-size must be >= 1, got {cp}")
        return
    types = list(dict.fromkeys(args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]))
    for t in types:
        if t in NOT_AVAILABLE:
            err(f"--cp-comm-type {t}: {NOT_AVAILABLE[t]}")
        elif t not in CP_COMM_TYPES:
            err(f"--cp-comm-type {t!r}: megazero has {', '.join(CP_COMM_TYPES)}")
    if len(types) > 1:
        err(f"--cp-comm-type {' '.join(args.cp_comm_type)}: one type per layer is not available; give one "
            "type for all layers")
    if cp == 1:
        return
    comm = types[0] if types else "p2p"
    parts = 2 * cp if comm == "p2p" else cp
    tp = args.tensor_model_parallel_size
    sp = tp if args.sequence_parallel else 1
    if args.seq_length is not None and args.seq_length % (parts * sp):
        err(f"--seq-length {args.seq_length} is not divisible by {parts * sp} (--context-parallel-size {cp} "
            f"cuts the sequence in {parts} chunks for --cp-comm-type {comm}"
            f"{f', then TP {tp} for --sequence-parallel' if sp > 1 else ''})")
    heads, groups = args.num_attention_heads, args.num_query_groups or args.num_attention_heads
    if comm == "a2a" and heads and tp >= 1 and ((heads // tp) % cp or (groups // tp) % cp):
        err(f"--cp-comm-type a2a needs the attention heads ({heads}) and query groups ({groups}) per TP rank "
            f"divisible by --context-parallel-size {cp}")
    if args.attention_dropout:
        err(f"--context-parallel-size {cp} needs --attention-dropout 0 (got {args.attention_dropout}): the ring "
            "attention draws no dropout")
    if args.reset_attention_mask:
        err("--reset-attention-mask is not available with --context-parallel-size > 1 (the per-document mask "
            "would cross the CP chunks); drop it or use CP 1")


def derive_cp(args) -> None:
    """``--cp-comm-type``'s one value (validated to be one)."""
    if isinstance(args.cp_comm_type, list):
        args.cp_comm_type = args.cp_comm_type[0]
