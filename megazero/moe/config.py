"""MoEConfig: a Mixture-of-Experts GPT's expert layers, independent of any parallel layout.

A GPT is MoE when ``GPTConfig.moe`` is set. Layer ``n`` (0-based) holds an MoE block instead of
the dense MLP when ``layer_pattern[n]`` is 1. Megatron-LM's ``--moe-layer-freq`` (core_v0.20.0
``megatron/training/arguments.py`` ``moe_freq_type``) is an int ``N`` -- layer ``n`` is MoE when
``n % N == 0`` -- or a Python list expression such as ``"([1]*3+[0]*1)*2"`` whose length must
equal ``--num-layers`` (:func:`layer_pattern`).

Per token ``x`` (``[h]``) an MoE block computes::

    logits = W_r x                                    # router, [E] (fp32 with --moe-router-dtype fp32)
    p, S   = route(logits)                            # top-k experts S, their weights p (below)
    y      = sum_{e in S} p_e * Expert_e(x)  (+ g(x) * Shared(x))

``route`` follows ``megatron/core/transformer/moe/moe_utils.py`` ``topk_routing_with_score_function``:
softmax scores -- ``top-k(logits)`` then a softmax over the k (``pre_softmax`` False, Mixtral) or
``top-k(softmax(logits))`` (``pre_softmax`` True, Qwen-MoE and DeepSeek); sigmoid scores --
``top-k(sigmoid(logits) + expert_bias)`` picks, the sigmoids (without bias) normalized over the
k are the weights. Group-limited routing keeps per token the ``router_group_topk`` expert groups
whose top ``k / group_topk`` scores sum highest (megatron-core 0.16.1 ``group_limited_topk``;
transformers 5.24.0's ``DeepseekV3TopkRouter`` sums the top 2, the same rule when
``k / group_topk = 2`` as in DeepSeek-V3: docs/moe.md). ``topk_scaling_factor`` multiplies the weights.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Mapping

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


def layer_pattern(freq, num_layers: int) -> tuple[int, ...]:
    """``--moe-layer-freq`` as one 0/1 per layer: an int ``N`` (or its string) makes layer ``n``
    MoE when ``n % N == 0``; a list (or a string Python list expression of ``[...]``, ``+``,
    ``*`` and integers, evaluated without ``eval``) is the pattern itself and must hold
    ``num_layers`` entries. Raises ``ValueError`` naming the flag otherwise."""
    if isinstance(freq, str):
        freq = _pattern_value(freq) if "[" in freq else _int(freq)
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq {freq}: must be a positive int or a list of 0/1 per layer")
        return tuple(1 if n % freq == 0 else 0 for n in range(num_layers))
    pattern = tuple(int(v) for v in freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--moe-layer-freq {list(pattern)}: needs {num_layers} entries of 0 or 1 "
                         f"(one per layer, --num-layers {num_layers}), got {len(pattern)}")
    return pattern


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--moe-layer-freq {text!r}: not an int or a list expression") from None


def _pattern_value(text: str):
    """Evaluate a list expression of int literals, lists, ``+`` and ``*`` (Megatron's syntax)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(f"--moe-layer-freq {text!r}: only lists, ints, + and * are allowed")
    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"--moe-layer-freq {text!r}: not a list expression") from None
    if not isinstance(out, list):
        raise ValueError(f"--moe-layer-freq {text!r}: does not give a list")
    return out


@dataclass(frozen=True)
class MoEConfig:
    """The expert layers of a GPT (Megatron's ``--num-experts`` and ``--moe-*`` flags)."""

    num_experts: int
    """``--num-experts``: routed experts per MoE layer."""
    ffn_hidden_size: int
    """``--moe-ffn-hidden-size``: each routed expert's FFN size (default ``--ffn-hidden-size``)."""
    layer_pattern: tuple[int, ...]
    """One 0/1 per layer from ``--moe-layer-freq``: 1 where the layer's MLP is an MoE block."""
    router_topk: int = 2
    """``--moe-router-topk``: experts per token."""
    score_function: str = "softmax"
    """``--moe-router-score-function``: ``softmax`` or ``sigmoid``."""
    pre_softmax: bool = False
    """``--moe-router-pre-softmax``: softmax over all experts before the top-k (else over the k)."""
    topk_scaling_factor: float | None = None
    """``--moe-router-topk-scaling-factor``: multiplies the routing weights."""
    num_groups: int | None = None
    """``--moe-router-num-groups``: expert groups for group-limited routing."""
    group_topk: int | None = None
    """``--moe-router-group-topk``: groups kept per token."""
    router_dtype: str | None = None
    """``--moe-router-dtype``: ``fp32``/``fp64`` router logits and routing math; None: the input's."""
    load_balancing: tuple[str, ...] = ("aux_loss",)
    """``--moe-router-load-balancing-type``: ``aux_loss``, ``seq_aux_loss`` and/or ``none``."""
    aux_loss_coeff: tuple[float, ...] = (0.0,)
    """``--moe-aux-loss-coeff``: one coefficient per load-balancing type."""
    z_loss_coeff: float | None = None
    """``--moe-z-loss-coeff``: router z-loss ``coeff * mean(logsumexp(logits)^2)``."""
    enable_expert_bias: bool = False
    """``--moe-router-enable-expert-bias``: DeepSeek-V3's aux-loss-free balancing bias."""
    bias_update_rate: float = 1e-3
    """``--moe-router-bias-update-rate``: the bias moves ``rate * sign(mean load - load)`` per step."""
    shared_expert_intermediate_size: int | None = None
    """``--moe-shared-expert-intermediate-size``: FFN size of the shared expert (None: none)."""
    shared_expert_gate: bool = False
    """``--moe-shared-expert-gate``: scale the shared expert by ``sigmoid(w_g x)`` (Qwen-MoE)."""
    capacity_factor: float | None = None
    """``--moe-expert-capacity-factor``: None is dropless; else capacity ``ceil(T k / E * factor)``."""
    token_drop_policy: str = "probs"
    """``--moe-token-drop-policy``: over capacity, keep the highest-weight (``probs``) or the
    earliest (``position``) tokens of each expert."""
    pad_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: every expert computes exactly ``capacity`` rows."""
    token_dispatcher: str = "alltoall"
    """``--moe-token-dispatcher-type``: ``alltoall`` or ``allgather``."""
    per_layer_logging: bool = False
    """``--moe-per-layer-logging``: TensorBoard ``moe/<metric>_layer_<n>`` scalars too."""

    def __post_init__(self) -> None:
        E, k = self.num_experts, self.router_topk
        problems = []
        if E < 1:
            problems.append(f"--num-experts {E} must be positive")
        if not 1 <= k <= max(E, 1):
            problems.append(f"--moe-router-topk {k} must be between 1 and --num-experts {E}")
        if self.score_function not in SCORE_FUNCTIONS:
            problems.append(f"--moe-router-score-function {self.score_function!r}: one of {SCORE_FUNCTIONS}")
        bad = [t for t in self.load_balancing if t not in LOAD_BALANCING_TYPES]
        if bad:
            problems.append(f"--moe-router-load-balancing-type {bad[0]!r}: megazero has {LOAD_BALANCING_TYPES}")
        if len(self.aux_loss_coeff) != len(self.load_balancing):
            problems.append(f"--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type "
                            f"({len(self.load_balancing)}), got {len(self.aux_loss_coeff)}")
        if (self.num_groups is None) != (self.group_topk is None):
            problems.append("--moe-router-num-groups and --moe-router-group-topk go together")
        elif self.num_groups is not None:
            if E % self.num_groups or not 1 <= self.group_topk <= self.num_groups or k % self.group_topk:
                problems.append(f"group-limited routing needs --num-experts {E} divisible by "
                                f"--moe-router-num-groups {self.num_groups}, 1 <= --moe-router-group-topk "
                                f"{self.group_topk} <= groups, and --moe-router-topk {k} divisible by it")
            elif k // self.group_topk > E // self.num_groups:
                problems.append(f"--moe-router-topk {k} / --moe-router-group-topk {self.group_topk} exceeds "
                                f"the {E // self.num_groups} experts of a group")
        if self.router_dtype not in ROUTER_DTYPES:
            problems.append(f"--moe-router-dtype {self.router_dtype!r}: one of fp32, fp64")
        if self.enable_expert_bias and self.score_function != "sigmoid":
            problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            problems.append(f"--moe-expert-capacity-factor {self.capacity_factor} must be > 0 (Megatron reads a "
                            "negative value as dropless: omit the flag for a dropless MoE)")
        if self.pad_to_capacity and self.capacity_factor is None:
            problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.token_drop_policy not in DROP_POLICIES:
            problems.append(f"--moe-token-drop-policy {self.token_drop_policy!r}: one of {DROP_POLICIES}")
        if self.token_dispatcher not in DISPATCHERS:
            problems.append(f"--moe-token-dispatcher-type {self.token_dispatcher!r}: megazero has {DISPATCHERS} "
                            "('flex' needs DeepEP/HybridEP kernels; use alltoall)")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            problems.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layer_pattern)

    def is_moe(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) is an MoE layer. Numbers past the decoder
        are multi-token-prediction layers (:mod:`megazero.model.mtp`), which follow the last
        decoder layer (megatron-core 0.16.1 ``get_gpt_mtp_block_spec`` uses ``layer_specs[-1]``)."""
        return bool(self.layer_pattern[min(layer_number, len(self.layer_pattern) - 1)])

    def coeff(self, kind: str) -> float:
        """The aux-loss coefficient of load-balancing type ``kind`` (0 when not enabled)."""
        return float(dict(zip(self.load_balancing, self.aux_loss_coeff)).get(kind, 0.0))

    @classmethod
    def from_megatron(cls, values: Mapping, num_layers: int, ffn_hidden_size: int) -> "MoEConfig | None":
        """From Megatron-named values (``num_experts``, ``moe_*``); None when ``num_experts`` is
        None or 0 (a dense model, as Megatron reads 0)."""
        E = values.get("num_experts")
        if not E:
            return None
        get = lambda name, default: default if values.get(name) is None else values[name]  # noqa: E731
        lb = get("moe_router_load_balancing_type", "aux_loss")
        coeff = get("moe_aux_loss_coeff", 0.0)
        lb = (lb,) if isinstance(lb, str) else tuple(lb)
        coeff = (float(coeff),) if isinstance(coeff, (int, float)) else tuple(float(c) for c in coeff)
        return cls(num_experts=int(E), ffn_hidden_size=int(get("moe_ffn_hidden_size", ffn_hidden_size)),
                   layer_pattern=layer_pattern(get("moe_layer_freq", 1), num_layers),
                   router_topk=int(get("moe_router_topk", 2)),
                   score_function=get("moe_router_score_function", "softmax"),
                   pre_softmax=bool(get("moe_router_pre_softmax", False)),
                   topk_scaling_factor=values.get("moe_router_topk_scaling_factor"),
                   num_groups=values.get("moe_router_num_groups"), group_topk=values.get("moe_router_group_topk"),
                   router_dtype=values.get("moe_router_dtype"), load_balancing=lb, aux_loss_coeff=coeff,
                   z_loss_coeff=values.get("moe_z_loss_coeff"),
                   enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
                   bias_update_rate=float(get("moe_router_bias_update_rate", 1e-3)),
                   shared_expert_intermediate_size=values.get("moe_shared_expert_intermediate_size"),
                   shared_expert_gate=bool(get("moe_shared_expert_gate", False)),
                   capacity_factor=values.get("moe_expert_capacity_factor"),
                   token_drop_policy=get("moe_token_drop_policy", "probs"),
                   pad_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False)),
                   token_dispatcher=get("moe_token_dispatcher_type", "alltoall"),
                   per_layer_logging=bool(get("moe_per_layer_logging", False)))

    def to_args(self) -> dict:
        """Megatron-named, JSON-ready (what a checkpoint's args record); inverse of :meth:`from_megatron`."""
        lb = self.load_balancing[0] if len(self.load_balancing) == 1 else list(self.load_balancing)
        coeff = self.aux_loss_coeff[0] if len(self.aux_loss_coeff) == 1 else list(self.aux_loss_coeff)
        return {"num_experts": self.num_experts, "moe_ffn_hidden_size": self.ffn_hidden_size,
                "moe_layer_freq": list(self.layer_pattern), "moe_router_topk": self.router_topk,
                "moe_router_score_function": self.score_function, "moe_router_pre_softmax": self.pre_softmax,
                "moe_router_topk_scaling_factor": self.topk_scaling_factor,
                "moe_router_num_groups": self.num_groups, "moe_router_group_topk": self.group_topk,
                "moe_router_dtype": self.router_dtype, "moe_router_load_balancing_type": lb,
                "moe_aux_loss_coeff": coeff, "moe_z_loss_coeff": self.z_loss_coeff,
                "moe_router_enable_expert_bias": self.enable_expert_bias,
                "moe_router_bias_update_rate": self.bias_update_rate,
                "moe_shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "moe_shared_expert_gate": self.shared_expert_gate,
                "moe_expert_capacity_factor": self.capacity_factor,
                "moe_token_drop_policy": self.token_drop_policy,
                "moe_pad_expert_input_to_capacity": self.pad_to_capacity,
                "moe_token_dispatcher_type": self.token_dispatcher,
                "moe_per_layer_logging": self.per_layer_logging}


MOE_ARG_KEYS = tuple(MoEConfig(num_experts=2, ffn_hidden_size=1, layer_pattern=(1,)).to_args())
# The subset that fixes the weights' shapes.
MOE_SHAPE_KEYS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                  "moe_shared_expert_gate")
