"""GPTConfig: the model's shape and behaviour, independent of any parallel layout.

The rules that derive one size from others live here and nowhere else:

* FFN size (:func:`default_ffn_hidden_size`): ``4 h``, or with SwiGLU ``64 * floor(8 h / 3 / 64)``
  (at least 64), so that the gate + up + down matrices hold about as many weights as ``4 h``'s two;
* vocabulary padding (:func:`pad_vocab_size`): ``V`` rounded up to a multiple of
  ``make_vocab_size_divisible_by * TP``, so every TP shard of the vocabulary is equal;
* the model's arguments as Megatron names them (:data:`ARG_KEYS`, :meth:`GPTConfig.to_args`,
  :meth:`GPTConfig.from_megatron`): what a checkpoint records and what a load checks (:data:`SHAPE_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Mapping

import torch

from megazero.moe.config import MOE_ARG_KEYS, MOE_SHAPE_KEYS, MoEConfig

from .mla_config import MLA_ARG_KEYS, MLA_SHAPE_KEYS, mla_from_megatron, mla_problem, mla_to_args

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")

# The model's arguments under Megatron's flag names (``dest`` form), as a checkpoint saves them.
ARG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "seq_length",
            "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization", "norm_epsilon",
            "swiglu", "openai_gelu", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
            "init_method_std", "seed", "params_dtype", "apply_layernorm_1p", "qk_layernorm", "window_size") \
    + MOE_ARG_KEYS + MLA_ARG_KEYS + ("mtp_num_layers", "mtp_loss_scaling_factor")
# The fields :meth:`GPTConfig.from_megatron` takes by the same name when given (not None).
_FROM_MEGATRON = ("num_layers", "hidden_size", "num_attention_heads", "make_vocab_size_divisible_by",
                  "ffn_hidden_size", "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
                  "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "add_bias_linear",
                  "add_qkv_bias", "untie_embeddings_and_output_weights", "attention_dropout", "hidden_dropout",
                  "init_method_std", "seed", "params_dtype", "recompute_granularity", "recompute_method",
                  "recompute_num_layers", "qk_layernorm", "mtp_num_layers", "mtp_loss_scaling_factor")
# The subset that fixes the weights' shapes: a checkpoint loads only into a model that agrees on
# all of them (``max_position_embeddings`` only with learned positions).
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "vocab_size", "max_position_embeddings", "position_embedding_type",
              "normalization", "swiglu", "add_bias_linear", "add_qkv_bias",
              "untie_embeddings_and_output_weights", "qk_layernorm") + MOE_SHAPE_KEYS + MLA_SHAPE_KEYS + ("mtp_num_layers",)


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """``4 h``; with SwiGLU ``64 * floor(8 h / 3 / 64)`` (at least 64), Megatron's choice."""
    return (int(8 * hidden_size / 3 / 64) * 64 or 64) if swiglu else 4 * hidden_size


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tp`` (equal TP shards)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    """Everything the GPT needs; ``from_megatron`` maps Megatron-named values onto it.

    ``vocab_size`` is the real vocabulary; ``padded_vocab_size`` (optional) the padded one. When
    it is None the model pads to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron's
    rule). Parameters beyond the real vocabulary are zero and get no probability mass.
    ``activation``: ``gelu`` (exact), ``gelu_tanh`` (GPT-2's) or ``swiglu`` (gate, up -> silu(gate) * up).
    ``add_bias_linear``: a bias on every linear layer (QKV, dense, fc1, fc2); ``add_qkv_bias``
    (Megatron's ``--add-qkv-bias``, Qwen2's attention): on the QKV projection only,
    ``[q; k; v] = W x + b``. The QKV layer has a bias when either is set (:attr:`qkv_bias`), as
    Megatron-LM core_v0.16.0's ``linear_qkv`` (``bias=add_bias_linear or add_qkv_bias``).
    ``recompute_granularity``: None, ``full`` (``recompute_method`` ``uniform``: chunks of
    ``recompute_num_layers`` layers; ``block``: the first ``recompute_num_layers`` layers of each
    model slice; None: every layer) or ``selective`` (core attention only).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    padded_vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int = 1024
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False  # norm weights stored as w, applied as 1 + w (start at 0)
    activation: str = "gelu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on the QKV projection alone (implied by add_bias_linear)
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    seed: int = 1234
    params_dtype: torch.dtype = field(default=torch.float32)
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    label_smoothing: float = 0.0
    moe: MoEConfig | None = None  # Mixture of Experts (megazero.moe.config); None: dense
    cp_comm_type: str = "p2p"  # attention across context-parallel ranks: "p2p" (ring) or "a2a" (Ulysses)
    # QK normalization and sliding-window attention (Qwen3, Mistral; model/attention.py has the math).
    # qk_layernorm: Megatron's --qk-layernorm: a `normalization` norm of each head's q and k (weights of
    # size kv_channels shared by all heads), before RoPE. window_size: Megatron's --window-size (left,
    # right): query i attends keys i - left .. i (causal: right 0; HF Mistral's sliding_window W is
    # (W - 1, 0)); None or left -1: the whole causal prefix.
    qk_layernorm: bool = False
    window_size: tuple[int, int] | None = None
    # Multi-latent attention (DeepSeek-V2/V3; model/mla.py has the math, model/mla_config.py the names,
    # Megatron's defaults and checks). Off: none of the others is read.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: the query projected directly (no compression)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # per-head query/key part without position (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 64  # the decoupled RoPE part, one key shared by all heads (HF qk_rope_head_dim)
    v_head_dim: int = 128
    rope_type: str | None = None  # MLA: None or "yarn" (Megatron's MLA default) or "rope"
    rotary_scaling_factor: float = 1.0  # YaRN's factor (HF rope_scaling.factor)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # -- multi-token prediction (megazero.model.mtp; Megatron's --mtp-num-layers, --mtp-loss-scaling-factor)
    mtp_num_layers: int | None = None  # D extra layers predicting t+2..t+D+1 on the last stage; None: none
    mtp_loss_scaling_factor: float = 0.1  # c: (c / D) * sum of the D MTP losses joins the LM loss's gradient

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.num_query_groups is None:
            put("num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")
            put("kv_channels", self.hidden_size // self.num_attention_heads)
        if self.ffn_hidden_size is None:
            put("ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.activation == "swiglu"))
        if self.max_position_embeddings is None:
            put("max_position_embeddings", self.seq_length)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} not in {ACTIVATIONS}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {self.normalization!r} not LayerNorm or RMSNorm")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} unknown")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"heads {self.num_attention_heads} not divisible by query groups {self.num_query_groups}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity {self.recompute_granularity!r} unknown")
        if self.cp_comm_type not in ("p2p", "a2a"):
            raise ValueError(f"--cp-comm-type {self.cp_comm_type!r}: megazero has p2p (ring) and a2a (Ulysses)")
        put("window_size", checked_window(self.window_size))
        if mla_problem(self) is not None:
            raise ValueError(mla_problem(self))
        if self.moe is not None and len(self.moe.layer_pattern) != self.num_layers:
            raise ValueError(f"the MoE layer pattern has {len(self.moe.layer_pattern)} entries for "
                             f"{self.num_layers} layers")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers {self.mtp_num_layers} must be >= 1 (omit it for no MTP)")
        if self.mtp_num_layers and self.position_embedding_type != "rope":
            raise ValueError(f"--mtp-num-layers needs --position-embedding-type rope, as in Megatron-LM")
        if self.moe is not None and self.add_bias_linear:
            raise ValueError("MoE experts have no biases (Megatron's grouped experts refuse them): "
                             "pass --disable-bias-linear")

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias: ``add_bias_linear or add_qkv_bias``."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def window_left(self) -> int | None:
        """How many earlier positions a query sees besides its own (``--window-size``'s left), or None."""
        return None if self.window_size is None else self.window_size[0]

    @property
    def swiglu(self) -> bool:
        return self.activation == "swiglu"

    @property
    def layernorm(self) -> bool:
        """LayerNorm (weight and bias) rather than RMSNorm (weight only)."""
        return self.normalization == "LayerNorm"

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type == "learned_absolute"

    def padded_vocab(self, tp: int) -> int:
        """The padded vocabulary for ``tp`` ranks (``padded_vocab_size`` if given)."""
        if self.padded_vocab_size is not None:
            if self.padded_vocab_size % tp or self.padded_vocab_size < self.vocab_size:
                raise ValueError(f"padded_vocab_size {self.padded_vocab_size} must be >= vocab_size "
                                 f"{self.vocab_size} and divisible by TP {tp}")
            return self.padded_vocab_size
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def check_cp(self, cp: int, tp: int = 1) -> None:
        """Raise unless context parallelism over ``cp`` ranks can run this model: the sequence
        cut in ``2 CP`` chunks (ring) or ``CP`` (all-to-all, with the TP-local heads and query
        groups divisible by CP), no attention dropout (the ring's blocks draw no masks)."""
        if cp == 1:
            return
        parts = 2 * cp if self.cp_comm_type == "p2p" else cp
        if self.seq_length % (parts * (tp if self.sequence_parallel else 1)):
            raise ValueError(f"--seq-length {self.seq_length} is not divisible by {parts} (--context-parallel-size {cp}, "
                             f"--cp-comm-type {self.cp_comm_type}{' x TP with SP' if self.sequence_parallel else ''})")
        if self.cp_comm_type == "a2a" and ((self.num_attention_heads // tp) % cp or (self.num_query_groups // tp) % cp):
            raise ValueError(f"--cp-comm-type a2a needs the heads {self.num_attention_heads} and query groups "
                             f"{self.num_query_groups} per TP rank divisible by --context-parallel-size {cp}")
        if self.attention_dropout > 0:
            raise ValueError("context parallelism needs --attention-dropout 0 (the ring attention draws no dropout)")

    def check_tp(self, tp: int, etp: int = 1) -> None:
        """Raise unless the TP-split sizes divide by ``tp`` (the experts' by ``etp``, the
        expert-tensor-parallel size)."""
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):  # MLA: heads split per rank
            if getattr(self, name) % tp:
                raise ValueError(f"{name} {getattr(self, name)} is not divisible by TP {tp}")
        if self.moe is not None:
            if self.moe.ffn_hidden_size % etp:
                raise ValueError(f"moe_ffn_hidden_size {self.moe.ffn_hidden_size} is not divisible by "
                                 f"expert TP {etp}")
            shared = self.moe.shared_expert_intermediate_size
            if shared and shared % tp:
                raise ValueError(f"moe_shared_expert_intermediate_size {shared} is not divisible by TP {tp}")

    @classmethod
    def from_megatron(cls, values: Mapping, vocab_size: int | None = None,
                      padded_vocab_size: int | None = None) -> "GPTConfig":
        """From values under Megatron's argument names (:data:`ARG_KEYS` and the dropout, SP and
        recompute settings): the validated flags (``megazero.config.model.gpt_config``) or a
        checkpoint's saved arguments (:meth:`from_saved_args`). A name that is absent or None
        takes the field's default. ``vocab_size``: the tokenizer's (default ``values["vocab_size"]``);
        ``padded_vocab_size``: None pads per TP by the rule above."""
        given = {k: v for k, v in values.items() if v is not None}
        vocab = vocab_size if vocab_size is not None else given.get("vocab_size")
        if vocab is None:
            raise ValueError("the vocabulary size is unknown (no tokenizer and no --vocab-size)")
        activation = "swiglu" if given.get("swiglu") else ("gelu_tanh" if given.get("openai_gelu") else "gelu")
        kwargs = {name: given[name] for name in _FROM_MEGATRON if name in given}
        if "rotary_base" in kwargs:
            kwargs["rotary_base"] = float(kwargs["rotary_base"])
        layers = kwargs.get("num_layers")
        ffn = kwargs.get("ffn_hidden_size") or default_ffn_hidden_size(kwargs.get("hidden_size", 0),
                                                                       activation == "swiglu")
        moe = MoEConfig.from_megatron(given, layers, ffn) if layers is not None else None
        cp_comm = given.get("cp_comm_type", "p2p")  # Megatron's is a list (one type for all layers here)
        cp_comm = cp_comm[0] if isinstance(cp_comm, (list, tuple)) and len(cp_comm) == 1 else cp_comm
        return cls(vocab_size=vocab, padded_vocab_size=padded_vocab_size, activation=activation,
                   apply_layernorm_1p=bool(given.get("apply_layernorm_1p", False)),
                   sequence_parallel=bool(given.get("sequence_parallel", False)), moe=moe,
                   cp_comm_type=cp_comm, window_size=given.get("window_size"), **mla_from_megatron(given), **kwargs)

    @classmethod
    def from_saved_args(cls, saved: dict, **overrides) -> "GPTConfig":
        """The model a checkpoint's saved arguments describe (``padded_vocab_size`` left None:
        re-padded for the loading TP); ``overrides`` replace fields afterwards. Dropout, SP and
        recompute are not read from it (a run's, not the weights')."""
        a = {k: saved.get(k) for k in ARG_KEYS}
        a["params_dtype"] = getattr(torch, a.get("params_dtype") or "float32")
        a["openai_gelu"] = bool(saved.get("openai_gelu", False))
        a["moe_layer_freq"] = saved.get("moe_layer_freq")  # a list: the pattern itself
        config = cls.from_megatron(a)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"not GPTConfig fields: {unknown}")
        return replace_config(config, **overrides)

    def to_args(self, tp: int = 1) -> dict:
        """This config under Megatron's argument names (:data:`ARG_KEYS`), JSON-ready; the
        padded vocabulary is the one for ``tp`` ranks."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads, "num_query_groups": self.num_query_groups,
                "kv_channels": self.kv_channels, "ffn_hidden_size": self.ffn_hidden_size,
                "vocab_size": self.vocab_size, "padded_vocab_size": self.padded_vocab(tp),
                "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by, "seq_length": self.seq_length,
                "max_position_embeddings": self.max_position_embeddings,
                "position_embedding_type": self.position_embedding_type, "rotary_base": self.rotary_base,
                "normalization": self.normalization, "norm_epsilon": self.norm_epsilon,
                "apply_layernorm_1p": self.apply_layernorm_1p,
                "swiglu": self.activation == "swiglu", "openai_gelu": self.activation == "gelu_tanh",
                "add_bias_linear": self.add_bias_linear, "add_qkv_bias": self.qkv_bias,
                "untie_embeddings_and_output_weights": self.untie_embeddings_and_output_weights,
                "init_method_std": self.init_method_std, "seed": self.seed,
                "params_dtype": str(self.params_dtype).replace("torch.", ""), "qk_layernorm": self.qk_layernorm,
                "window_size": None if self.window_size is None else list(self.window_size),
                **(self.moe.to_args() if self.moe is not None else {"num_experts": None}), **mla_to_args(self),
                "mtp_num_layers": self.mtp_num_layers, "mtp_loss_scaling_factor": self.mtp_loss_scaling_factor}


def checked_window(window) -> tuple[int, int] | None:
    """``--window-size`` as a ``(left, right)`` tuple of ints (a checkpoint's JSON list too); None
    for none or Megatron's infinite left (-1). Raises unless causal (right 0) with left >= 0."""
    if window is None:
        return None
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"--window-size {window!r}: expected two integers (left,right), e.g. 4095,0") from None
    if right != 0 or left < -1:
        raise ValueError(f"--window-size {left},{right}: megazero's GPT attention is causal; give left >= 0 "
                         "(or -1: no window) and right 0")
    return None if left == -1 else (left, right)


def replace_config(config: GPTConfig, **changes) -> GPTConfig:
    """A copy of ``config`` with ``changes`` (configs are frozen)."""
    return replace(config, **changes)
