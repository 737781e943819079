"""ZeRO data parallelism (stages 0-3), mixed precision, loss scaling and global clipping.

Imports only ``megazero.parallel.topology`` (through the caller) and torch.  See docs/zero.md.
"""

from .collectives import PRIMITIVES, Collectives
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .optimizer import ZeroOptimizer
from .stage3 import find_units

__all__ = ["ZeroOptimizer", "DynamicLossScaler", "ConstantLossScaler", "Collectives", "PRIMITIVES", "find_units"]
