"""``megazero.initialize`` and its engine: DeepSpeed's API for any ``torch.nn.Module`` over
megazero's ZeRO 0-3 (:mod:`megazero.zero`). See docs/any_model.md."""

from .engine import ZeroEngine
from .initialize import initialize
from .optimizer import EngineOptimizer

__all__ = ["initialize", "ZeroEngine", "EngineOptimizer"]
