"""The training loop and what it is built from: build order, LR schedule, logger, signals."""

from .build import setup
from .entry import pretrain
from .loop import Trainer

__all__ = ["Trainer", "pretrain", "setup"]
