"""The GPT model: config, transformer layers from tensor-parallel pieces, HF conversion (hf.py)."""

from .config import GPTConfig
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
