"""The config's ``scheduler`` block as an object on the engine optimizer's param groups.

DeepSpeed's WarmupLR / WarmupDecayLR write one rate into every param group; WarmupCosineLR
scales each group's initial rate by the schedule's ratio (deepspeed/runtime/lr_schedules.py,
0.19.8). The rate after ``n`` optimizer steps is :class:`~megazero.optim.lr_schedule.
DeepSpeedLRScheduler`'s (the same function ``pretrain_gpt.py --deepspeed-config`` uses).
"""

from __future__ import annotations

from megazero.optim.lr_schedule import DeepSpeedLRScheduler


class GroupLRScheduler:
    """Applies a :class:`DeepSpeedLRScheduler` to ``optimizer.param_groups``."""

    def __init__(self, optimizer, settings: dict):
        self.optimizer = optimizer
        self.schedule = DeepSpeedLRScheduler(**settings)
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule.get_lr()
        if self.schedule.type == "WarmupCosineLR":
            ratio = lr / self.schedule.base_lr if self.schedule.base_lr else 0.0
            rates = [b * ratio for b in self.base_lrs]
        else:
            rates = [lr] * len(self.base_lrs)
        for g, r in zip(self.optimizer.param_groups, rates):
            g["lr"] = r

    def step(self) -> None:
        """After an applied optimizer step: the rates of the next one."""
        self.schedule.step()
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        self._apply()
