"""The model's config from the flags: Megatron's argument names onto :class:`GPTConfig`."""

from __future__ import annotations

from megazero.model.config import GPTConfig


def gpt_config(args, vocab_size: int | None = None, padded_vocab_size: int | None = None) -> GPTConfig:
    """The frozen :class:`GPTConfig` of a parsed namespace (``parse_args``' or any namespace with
    Megatron's names); ``vocab_size``: the tokenizer's (default ``--vocab-size``), padded per TP
    unless ``padded_vocab_size`` is given. Raises ``ValueError`` naming an inconsistent size."""
    return GPTConfig.from_megatron(vars(args), vocab_size=vocab_size, padded_vocab_size=padded_vocab_size)
