"""Learning-rate schedules: Megatron-LM's (counted in samples) and DeepSpeed's (in optimizer steps).

:func:`build_lr_scheduler` picks the one the arguments ask for: a ``scheduler`` block of the
``--deepspeed-config`` (``args.deepspeed_scheduler``, resolved by :mod:`megazero.config.deepspeed_config`)
gives a :class:`DeepSpeedLRScheduler`, otherwise the Megatron flags give an :class:`LRScheduler`.
Both have the same interface: ``get_lr(n=None)``, ``step()``, ``num_steps``, ``state_dict()`` /
``load_state_dict(state, override=False)``; iteration ``i`` (1-based) trains with ``get_lr()``
taken before its ``step()``, i.e. the rate for ``n = i - 1``.

Megatron (:class:`LRScheduler`, Megatron-LM core_v0.19.0 ``OptimizerParamScheduler``):

The schedule counts *samples*: every applied optimizer step advances it by that step's global
batch size (a skipped fp16-overflow step does not advance it). With ``W`` warm-up and ``D`` decay
steps, peak ``lr``, floor ``min_lr`` and start ``init_lr`` (``--lr-warmup-init``), after ``n``::

    n <= W (W > 0):   init_lr + (lr - init_lr) * n / W
    constant style:   lr
    n >  D:           min_lr
    otherwise:        min_lr + c(r) * (lr - min_lr),   r = (n - W) / (D - W)
        linear: c = 1 - r       cosine: c = (1 + cos(pi * r)) / 2

:func:`build_lr_scheduler` takes ``D = --lr-decay-iters * B`` (default ``--train-iters``) and
``W = --lr-warmup-iters * B`` for iteration-based runs, ``D = --lr-decay-samples`` (default
``--train-samples``) and ``W = --lr-warmup-samples`` for sample-based ones; with
``--lr-warmup-fraction f``, ``W = f * D``. Iteration ``i`` trains with the rate for the samples of
the ``i - 1`` earlier applied steps, so warm-up starts at ``init_lr``; the log line prints the
rate after the step (what the next iteration uses), as Megatron prints it.

:meth:`LRScheduler.state_dict` saves ``n`` with the settings. Loading checks the settings equal
the flags' (a changed schedule is named, not silently applied), unless
``--override-opt_param-scheduler`` (keep the flags') or ``--use-checkpoint-opt_param-scheduler``
(take the checkpoint's), as Megatron.
"""

from __future__ import annotations

import math

from megazero.config.configs import LRConfig

DEEPSPEED_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class LRScheduler:
    SETTINGS = ("lr", "min_lr", "warmup_iters", "decay_iters", "decay_style")  # compared on load

    def __init__(self, lr: float, min_lr: float = 0.0, warmup_iters: float = 0, decay_iters: float | None = None,
                 decay_style: str = "linear", *, init_lr: float = 0.0, override: bool = False,
                 use_checkpoint: bool = False, samples_per_step: int = 1):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {decay_style!r}")
        if decay_iters is not None and decay_iters < warmup_iters:
            raise ValueError(f"the LR decay length {decay_iters} is smaller than the warm-up {warmup_iters}")
        self.lr, self.min_lr, self.init_lr = float(lr), float(min_lr), float(init_lr)
        self.warmup_iters, self.decay_iters, self.decay_style = warmup_iters, decay_iters, decay_style
        self.override, self.use_checkpoint = override, use_checkpoint
        self.samples_per_step = samples_per_step  # converts a state counted in iterations (see load)
        self.num_steps = 0

    def get_lr(self, n: float | None = None, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate after ``n`` samples (default: the steps taken). ``max_lr``/``min_lr``: another
        peak and floor on the same warm-up and decay (Megatron's param-group ``max_lr``/``min_lr``,
        how ``--decoupled-lr``/``--decoupled-min-lr`` reach the embedding and output layer)."""
        n = self.num_steps if n is None else n
        peak = self.lr if max_lr is None else float(max_lr)
        floor = self.min_lr if min_lr is None else float(min_lr)
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.init_lr + (peak - self.init_lr) * n / self.warmup_iters
        if self.decay_style == "constant":
            return peak
        if self.decay_iters is None or n > self.decay_iters:
            return floor if self.decay_iters is not None else peak
        span = self.decay_iters - self.warmup_iters
        ratio = (n - self.warmup_iters) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return floor + coeff * (peak - floor)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` (Megatron: the applied step's global batch size); return the
        rate the next iteration trains with."""
        self.num_steps += increment
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "init_lr": self.init_lr, "unit": "samples",
                **{k: getattr(self, k) for k in self.SETTINGS}}

    def load_state_dict(self, state: dict, override: bool = False) -> None:
        """Restore ``num_steps``; the settings: the flags' (``override``), the checkpoint's
        (``use_checkpoint``), or else they must be equal. A state without ``unit`` was saved by
        megazero before the schedule counted samples: its step, warm-up and decay counts are
        iterations, converted at this run's constant ``samples_per_step`` (the global batch)."""
        if "unit" not in state:
            b = self.samples_per_step
            state = dict(state, num_steps=state["num_steps"] * b, warmup_iters=state["warmup_iters"] * b,
                         decay_iters=None if state["decay_iters"] is None else state["decay_iters"] * b)
        for key in self.SETTINGS:
            if override or self.override:
                continue
            if self.use_checkpoint:
                setattr(self, key, state[key])
            elif state[key] != getattr(self, key):
                raise ValueError(f"LR schedule changed since the checkpoint: {key} was {state[key]!r}, now "
                                 f"{getattr(self, key)!r} (--override-opt_param-scheduler keeps the flags', "
                                 "--use-checkpoint-opt_param-scheduler takes the checkpoint's)")
        self.num_steps = state["num_steps"]


class DeepSpeedLRScheduler:
    """DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` (deepspeed/runtime/
    lr_schedules.py, checked against DeepSpeed 0.19.8 by tests/peers/test_deepspeed_schedules.py),
    as functions of the number of optimizer steps taken ``n``.

    DeepSpeed's scheduler starts at ``last_batch_iteration = -1`` and its ``step()`` runs after
    each applied optimizer step, so after ``n`` steps ``t = n - 1``. ``warmup_num_steps`` must be a
    positive integer (DeepSpeed raises otherwise); ``W = max(2, warmup_num_steps)``,
    ``T = total_num_steps``; during warm-up (``0 <= t < W``)::

        log:     g = ln(t + 1) / ln(W)          linear:  g = t / W

    WarmupLR:       t < 0: min;  t < W: min + (max - min) g;  else max
    WarmupDecayLR:  as WarmupLR, but for t >= W: min + (max - min) * max(0, (T - t) / max(1, T - W))
    WarmupCosineLR: rate = base_lr * ratio (base_lr = the optimizer's lr); t < 0: ratio 0;
                    t < W: wmr + (1 - wmr) g;  else with x = min(1, (t - W + 1) / max(1, T - W)):
                    max(0, cmr + (1 - cmr) (1 + cos(pi x)) / 2)   (wmr = warmup_min_ratio,
                    cmr = cos_min_ratio; clamped at cmr past T; T <= W is accepted, as DeepSpeed)

    (``min``/``max`` = ``warmup_min_lr``/``warmup_max_lr``; WarmupLR's ``max`` defaults to the
    optimizer's lr, resolved by the config merge.) The first optimizer step therefore trains with
    ``min`` (WarmupLR/WarmupDecayLR) or 0 (WarmupCosineLR), the second with g(0) = 0.
    """

    SETTINGS = ("type", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                "warmup_min_ratio", "cos_min_ratio", "base_lr")

    def __init__(self, type: str, *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", total_num_steps: int | None = None,
                 warmup_min_ratio: float = 0.0, cos_min_ratio: float = 0.0001, base_lr: float | None = None):
        if type not in DEEPSPEED_SCHEDULES:
            raise ValueError(f"unknown DeepSpeed scheduler {type!r}; one of {', '.join(DEEPSPEED_SCHEDULES)}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if type != "WarmupLR" and total_num_steps is None:
            raise ValueError(f"{type} needs total_num_steps")
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if type == "WarmupCosineLR" and base_lr is None:
            raise ValueError("WarmupCosineLR needs the optimizer's lr")
        self.type, self.warmup_type = type, warmup_type
        self.warmup_min_lr, self.warmup_max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps, self.total_num_steps = int(warmup_num_steps), total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.base_lr = None if base_lr is None else float(base_lr)
        self.num_steps = 0

    def _warmup_gamma(self, t: int, w: int) -> float:
        return math.log(t + 1) / math.log(w) if self.warmup_type == "log" else t / w

    def get_lr(self, n: int | None = None) -> float:
        t = (self.num_steps if n is None else n) - 1
        w = max(2, self.warmup_num_steps)
        if self.type == "WarmupCosineLR":
            if t < 0:
                return 0.0
            if t < w:
                ratio = self.warmup_min_ratio + self._warmup_gamma(t, w) * (1.0 - self.warmup_min_ratio)
            else:
                x = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
                ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * x)) / 2)
            return self.base_lr * ratio
        if t < 0:
            gamma = 0.0
        elif t < w:
            gamma = self._warmup_gamma(t, w)
        elif self.type == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - w))
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma

    def step(self) -> float:
        """Advance one optimizer step; return the rate the next iteration trains with."""
        self.num_steps += 1
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **{k: getattr(self, k) for k in self.SETTINGS}}

    def load_state_dict(self, state: dict, override: bool = False) -> None:
        """Restore ``num_steps``; unless ``override``, the saved settings must equal ours."""
        if not override:
            for key in self.SETTINGS:
                if state.get(key) != getattr(self, key):
                    raise ValueError(f"LR schedule changed since the checkpoint: {key} was {state.get(key)!r}, "
                                     f"now {getattr(self, key)!r}")
        self.num_steps = int(state["num_steps"])


def learning_rates(scheduler, lr: LRConfig) -> tuple[float, float | None]:
    """(lr, decoupled lr) the next step uses: the second is None without ``--decoupled-lr``, else
    the same schedule with peak ``--decoupled-lr`` and floor ``--decoupled-min-lr`` (default
    ``--min-lr``), as Megatron's param group ``max_lr``/``min_lr`` overrides."""
    if lr.decoupled_lr is None or not isinstance(scheduler, LRScheduler):
        return scheduler.get_lr(), None
    return scheduler.get_lr(), scheduler.get_lr(max_lr=lr.decoupled_lr, min_lr=lr.decoupled_min_lr)


def build_lr_scheduler(lr: LRConfig):
    """The scheduler the training loop uses: a ``--deepspeed-config`` scheduler block
    (:class:`DeepSpeedLRScheduler`'s keywords) or Megatron's, in samples (module docstring; the
    lengths in samples are :func:`megazero.config.run_config.lr_config`'s)."""
    if lr.deepspeed_scheduler:
        return DeepSpeedLRScheduler(**lr.deepspeed_scheduler)
    if lr.lr is None:
        raise ValueError("--lr is required (or a --deepspeed-config optimizer/scheduler block)")
    return LRScheduler(lr.lr, lr.min_lr, lr.warmup_samples, lr.decay_samples, lr.decay_style, init_lr=lr.warmup_init,
                       override=lr.override, use_checkpoint=lr.use_checkpoint, samples_per_step=lr.samples_per_step)
