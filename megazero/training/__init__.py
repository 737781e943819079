"""The training loop and what it is built from: build order, LR schedule, logger, signals."""

from .build import setup
from .loop import Trainer, pretrain

__all__ = ["Trainer", "pretrain", "setup"]
