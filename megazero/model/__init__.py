"""The GPT family: config (:mod:`.config`), transformer layers built from tensor-parallel pieces
(:mod:`.transformer`), the model (:mod:`.gpt`) and its pipeline glue (:mod:`.stages`). Models only:
MoE blocks are :mod:`megazero.moe`'s, context-parallel attention :mod:`megazero.context_parallel`'s,
conversion :mod:`megazero.checkpoint.convert`'s, generation :mod:`megazero.inference`'s."""

from .config import GPTConfig
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
