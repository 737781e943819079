"""Learning-rate schedule with Megatron-LM's semantics, counted in iterations.

With ``W`` warm-up iterations, ``D`` decay iterations, peak ``lr`` and floor ``min_lr``, the rate
after ``n`` optimizer steps is::

    n <= W (W > 0):   lr * n / W
    n >  D:           min_lr
    otherwise:        min_lr + c(r) * (lr - min_lr),   r = (n - W) / (D - W)
        constant: c = 1       linear: c = 1 - r       cosine: c = (1 + cos(pi * r)) / 2

Iteration ``i`` (1-based) trains with the rate for ``n = i - 1``, so warm-up starts at zero as
in Megatron. The state is just ``n``; :meth:`state_dict` saves it with the settings, and loading
checks the settings match (a changed schedule on resume is named, not silently applied).
"""

from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, lr: float, min_lr: float = 0.0, warmup_iters: int = 0, decay_iters: int | None = None,
                 decay_style: str = "linear"):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {decay_style!r}")
        if decay_iters is not None and decay_iters < warmup_iters:
            raise ValueError(f"--lr-decay-iters {decay_iters} is smaller than --lr-warmup-iters {warmup_iters}")
        self.lr, self.min_lr = float(lr), float(min_lr)
        self.warmup_iters, self.decay_iters, self.decay_style = warmup_iters, decay_iters, decay_style
        self.num_steps = 0

    def get_lr(self, n: int | None = None) -> float:
        n = self.num_steps if n is None else n
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.lr * n / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if self.decay_iters is None or n > self.decay_iters:
            return self.min_lr if self.decay_iters is not None else self.lr
        span = self.decay_iters - self.warmup_iters
        ratio = (n - self.warmup_iters) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def step(self) -> float:
        """Advance one iteration; return the rate the next iteration trains with."""
        self.num_steps += 1
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "lr": self.lr, "min_lr": self.min_lr,
                "warmup_iters": self.warmup_iters, "decay_iters": self.decay_iters, "decay_style": self.decay_style}

    def load_state_dict(self, state: dict, override: bool = False) -> None:
        """Restore ``num_steps``; unless ``override``, the saved settings must equal ours."""
        if not override:
            for key in ("lr", "min_lr", "warmup_iters", "decay_iters", "decay_style"):
                if state[key] != getattr(self, key):
                    raise ValueError(f"LR schedule changed since the checkpoint: {key} was {state[key]!r}, "
                                     f"now {getattr(self, key)!r}")
        self.num_steps = int(state["num_steps"])
