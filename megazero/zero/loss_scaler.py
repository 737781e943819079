"""Loss scalers with Megatron-LM's semantics (fp16); bf16/fp32 use a constant scale of 1.

The scale is a Python float (no device sync to read it); :attr:`ZeroOptimizer.loss_scale` hands
the schedule a tensor.  The schedule multiplies the loss's gradient by ``scale``; the optimizer unscales gradients by
``1/scale`` and reports whether any was inf/NaN (decided once for the whole world, so every rank
takes the same branch).  Dynamic rule, with ``hysteresis`` H and ``window`` W:

* overflow: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; when it reaches 0 the scale
  becomes ``max(scale * backoff, min_scale)`` (the tracker is not reset until the next growth,
  so later overflows back off immediately, as in Megatron).
* W consecutive clean steps: ``scale *= growth`` and ``hysteresis_tracker = H``.
"""

from __future__ import annotations


class ConstantLossScaler:
    """A fixed scale (``--loss-scale``, or 1.0 for bf16/fp32)."""

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])


class DynamicLossScaler:
    """Megatron-style dynamic loss scale (``--initial-loss-scale`` 2^32, ``--min-loss-scale``,
    ``--loss-scale-window`` 1000, ``--hysteresis`` 2; growth 2, backoff 0.5)."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2, growth: float = 2.0, backoff: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1:
            raise ValueError("loss scaler settings must be positive")
        self.scale = float(initial_scale)
        self.min_scale, self.window, self.hysteresis = float(min_scale), int(window), int(hysteresis)
        self.growth, self.backoff = float(growth), float(backoff)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["growth_tracker"])
        self.hysteresis_tracker = int(sd["hysteresis_tracker"])


def make_loss_scaler(params_dtype, loss_scale: float | None, dynamic_loss_scale: bool | None,
                     initial_loss_scale: float, min_loss_scale: float, loss_scale_window: int, hysteresis: int):
    """``loss_scale`` given: constant; dynamic when asked, or by default for fp16; else 1.0."""
    import torch
    if loss_scale is not None:
        return ConstantLossScaler(loss_scale)
    if dynamic_loss_scale or (dynamic_loss_scale is None and params_dtype == torch.float16):
        return DynamicLossScaler(initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
    return ConstantLossScaler(1.0)
