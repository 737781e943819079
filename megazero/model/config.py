"""GPTConfig: the model's shape and behaviour, independent of any parallel layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


@dataclass
class GPTConfig:
    """Everything the GPT needs; ``from_args`` maps Megatron's flags onto it.

    ``vocab_size`` is the real vocabulary; ``padded_vocab_size`` (optional) the padded one. When
    it is None the model pads to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron's
    rule). Parameters beyond the real vocabulary are zero and get no probability mass.
    ``activation``: ``gelu`` (exact), ``gelu_tanh`` (GPT-2's) or ``swiglu`` (gate, up -> silu(gate) * up).
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
    activation: str = "gelu"
    add_bias_linear: bool = True
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

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = ((int(8 * self.hidden_size / 3 / 64) * 64 or 64) if self.activation == "swiglu"
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
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

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab(self, tp: int) -> int:
        """The padded vocabulary for ``tp`` ranks (``padded_vocab_size`` if given)."""
        if self.padded_vocab_size is not None:
            if self.padded_vocab_size % tp or self.padded_vocab_size < self.vocab_size:
                raise ValueError(f"padded_vocab_size {self.padded_vocab_size} must be >= vocab_size "
                                 f"{self.vocab_size} and divisible by TP {tp}")
            return self.padded_vocab_size
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name} {getattr(self, name)} is not divisible by TP {tp}")

    @classmethod
    def from_args(cls, args) -> "GPTConfig":
        """From Megatron-style parsed args (``megazero.arguments.parse_args``); the vocabulary
        comes from ``args.vocab_size`` / ``args.padded_vocab_size`` (set once the tokenizer is known)."""
        vocab = getattr(args, "vocab_size", None)
        if vocab is None:
            raise ValueError("args.vocab_size is not set (call arguments.set_padded_vocab_size first)")
        return cls(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            vocab_size=vocab, padded_vocab_size=getattr(args, "padded_vocab_size", None),
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, ffn_hidden_size=args.ffn_hidden_size,
            num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type, rotary_base=float(args.rotary_base),
            normalization=args.normalization, norm_epsilon=args.norm_epsilon,
            activation="swiglu" if args.swiglu else "gelu", add_bias_linear=args.add_bias_linear,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
            init_method_std=args.init_method_std, seed=args.seed, params_dtype=args.params_dtype,
            sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        )
