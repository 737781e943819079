"""Multi-latent attention on the command line: Megatron-LM's ``mla`` group (megatron/training/
arguments.py ``_add_mla_args``, core_v0.16.0 .. core_v0.19.0: same names, types and defaults) and
``--rope-type`` (its ``rope``/``yarn`` choice, default None: MLA takes yarn), with their checks,
all before any process group. The model side (fields, math) is megazero/model/mla_config.py and
mla.py.

Megatron's rules kept: ``--group-query-attention`` is mutually exclusive with MLA; ``--rope-type
yarn`` is MLA's only. megazero adds, one line each: MLA needs ``--position-embedding-type rope``
(no learned positions on top of the decoupled RoPE part); ``--kv-channels`` and
``--num-query-groups`` have no meaning with MLA (its head sizes are ``--qk-head-dim`` +
``--qk-pos-emb-head-dim`` and ``--v-head-dim``; Megatron ignores them silently); the heads split
over TP as for standard attention; ``--qk-layernorm`` where the parser has it: Megatron's MLA has
its latent norms only with it, megazero's always does (DeepSeek-V2/V3), so MLA needs it.
"""

from __future__ import annotations


def add_mla_flags(p) -> None:
    """The ``mla`` group (Megatron's names and defaults)."""
    g = p.add_argument_group("mla")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention (DeepSeek-V2/V3): low-rank query and KV latents, shared RoPE key")
    g.add_argument("--q-lora-rank", type=int, default=None, help="rank of the query latent (default: no latent)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the key/value latent")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="per-head query/key size without position; q head = qk-head-dim + qk-pos-emb-head-dim")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="size of the decoupled RoPE part")
    g.add_argument("--v-head-dim", type=int, default=128, help="per-head value size")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's factor (1: plain RoPE)")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale of the rotary cos/sin")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN mscale of the softmax scale")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA's RoPE: yarn (default with MLA) or rope; standard attention: rope only")


def check_mla(err, args) -> None:
    """MLA's problems, each one ``err`` line (module docstring)."""
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":
            err("--rope-type yarn without --multi-latent-attention: megazero's YaRN is MLA's (standard attention "
                "takes plain rope)")
        return
    if args.group_query_attention or args.num_query_groups is not None:
        err("--multi-latent-attention with --group-query-attention/--num-query-groups: mutually exclusive "
            "(Megatron's rule): every head expands from the shared latent")
    if args.kv_channels is not None:
        err(f"--kv-channels {args.kv_channels} with --multi-latent-attention: MLA's head sizes are --qk-head-dim + "
            "--qk-pos-emb-head-dim (queries, keys) and --v-head-dim (values); drop --kv-channels")
    if args.position_embedding_type != "rope":
        err("--multi-latent-attention needs --position-embedding-type rope (its decoupled RoPE part; megazero adds "
            "no learned positions to MLA)")
    if args.add_qkv_bias:
        err("--add-qkv-bias with --multi-latent-attention: MLA has no QKV projection")
    for flag, value in (("--kv-lora-rank", args.kv_lora_rank), ("--qk-head-dim", args.qk_head_dim),
                        ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim), ("--v-head-dim", args.v_head_dim),
                        ("--q-lora-rank", args.q_lora_rank)):
        if value is not None and value < 1:
            err(f"{flag} {value}: must be a positive integer with --multi-latent-attention")
    if args.qk_pos_emb_head_dim % 2:
        err(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim}: RoPE rotates pairs, the size must be even")
    if args.rotary_scaling_factor <= 0:
        err(f"--rotary-scaling-factor {args.rotary_scaling_factor}: YaRN's factor must be > 0")
    if not args.qk_layernorm:
        err("--multi-latent-attention needs --qk-layernorm: megazero's MLA always normalizes its q/kv latents "
            "(DeepSeek-V2/V3); Megatron's MLA has those norms only with --qk-layernorm")
