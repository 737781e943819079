"""Loss scalers (fp16) with Megatron-LM's or DeepSpeed's rule; bf16/fp32 use a constant scale of 1.

The scale is a Python float (no device sync to read it); :attr:`ZeroOptimizer.loss_scale` hands
the schedule a tensor.  The schedule multiplies the loss's gradient by ``scale``; the optimizer unscales gradients by
``1/scale`` and reports whether any was inf/NaN (decided once for the whole world, so every rank
takes the same branch).  Dynamic rule, with ``hysteresis`` H and ``window`` W:

* overflow: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; when it reaches 0 the scale
  becomes ``max(scale * backoff, min_scale)`` (the tracker is not reset until the next growth,
  so later overflows back off immediately, as in Megatron).
* W consecutive clean steps: ``scale *= growth`` and ``hysteresis_tracker = H``.

:class:`DeepSpeedLossScaler` is DeepSpeed's rule (``megazero.initialize``, whose ds_config keys
mean what they mean in DeepSpeed); ``pretrain_gpt`` keeps Megatron's.
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


class DeepSpeedLossScaler:
    """DeepSpeed's dynamic loss scale (``DynamicLossScaler.update_scale``,
    deepspeed/runtime/fp16/loss_scaler.py 0.19.8; stage 0's ``FP16_Optimizer._update_scale`` is
    the same rule with hysteresis 1 and no error at the minimum). Counters start at
    ``cur_iter = 0``, ``last_overflow_iter = -1``, ``cur_hysteresis = H`` (``delayed_shift``);
    every update ends with ``cur_iter += 1``.

    * overflow: if ``H == 1`` or ``cur_hysteresis == 1``, the scale backs off to
      ``max(scale / 2, min_scale)`` (an error instead when it is already ``min_scale`` and
      ``raise_at_min``); else ``cur_hysteresis -= 1``. Then ``last_overflow_iter = cur_iter``.
    * clean: ``cur_hysteresis = H`` when ``consecutive_hysteresis``; with ``stable =
      cur_iter - last_overflow_iter - 1``, if ``stable > 0`` and ``stable % W == 0`` the scale
      doubles (and ``cur_hysteresis = H`` without ``consecutive_hysteresis``).

    So the first growth comes after ``W + 1`` clean steps (from the start or an overflow), later
    ones every ``W`` -- one step later than Megatron's rule (:class:`DynamicLossScaler`)."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, raise_at_min: bool = True):
        if initial_scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1:
            raise ValueError("loss scaler settings must be positive")
        self.scale, self.min_scale, self.window = float(initial_scale), float(min_scale), int(window)
        self.hysteresis, self.growth = int(hysteresis), 2.0
        self.consecutive_hysteresis, self.raise_at_min = bool(consecutive_hysteresis), bool(raise_at_min)
        self.cur_iter, self.last_overflow_iter, self.cur_hysteresis = 0, -1, self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_at_min:
                    raise RuntimeError(f"fp16 loss scale overflowed at fp16.min_loss_scale {self.min_scale} and "
                                       "cannot back off further (DeepSpeed stops here too); lower min_loss_scale")
                self.scale = max(self.scale / self.growth, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                self.cur_hysteresis = self.hysteresis
                self.scale *= self.growth
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, sd: dict) -> None:
        """DeepSpeed's counters; an older engine checkpoint's Megatron-rule ``growth_tracker`` g
        maps to ``cur_iter - last_overflow_iter = g + 2`` (growth ``W - g`` clean steps on, as
        Megatron's rule would have grown)."""
        self.scale = float(sd["scale"])
        if "growth_tracker" in sd:
            sd = {"cur_iter": int(sd["growth_tracker"]) + 1, "last_overflow_iter": -1,
                  "cur_hysteresis": max(int(sd["hysteresis_tracker"]), 1)}
        self.cur_iter, self.last_overflow_iter = int(sd["cur_iter"]), int(sd["last_overflow_iter"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])


def make_loss_scaler(params_dtype, loss_scale: float | None, dynamic_loss_scale: bool | None,
                     initial_loss_scale: float, min_loss_scale: float, loss_scale_window: int, hysteresis: int,
                     rule: str = "megatron", stage: int = 1):
    """``loss_scale`` given: constant; dynamic when asked, or by default for fp16; else 1.0.
    ``rule``: ``"megatron"`` (:class:`DynamicLossScaler`) or ``"deepspeed"``
    (:class:`DeepSpeedLossScaler`; ZeRO ``stage`` 0 does not raise at the minimum scale)."""
    import torch
    if loss_scale is not None:
        return ConstantLossScaler(loss_scale)
    if dynamic_loss_scale or (dynamic_loss_scale is None and params_dtype == torch.float16):
        if rule == "deepspeed":
            return DeepSpeedLossScaler(initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis,
                                       raise_at_min=stage > 0)
        return DynamicLossScaler(initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
    return ConstantLossScaler(1.0)
