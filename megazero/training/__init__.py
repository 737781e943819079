"""The training loop and what it is built from: build order, LR schedule, logger, signals."""

from .loop import Trainer, pretrain, setup

__all__ = ["Trainer", "pretrain", "setup"]
