"""The optimizer object ``megazero.initialize`` returns: a ``torch.optim.Optimizer`` whose
``param_groups`` are the user's (their ``lr``, ``betas``, ``eps``, ``weight_decay``), stepping
through a :class:`~megazero.zero.ZeroOptimizer` that holds the sharded fp32 masters and moments.

Being a ``torch.optim.Optimizer`` lets any torch LR scheduler drive it: the scheduler writes
``group["lr"]`` and :meth:`EngineOptimizer.step` reads every group's settings at each step, as
DeepSpeed's ZeRO optimizers expose their wrapped optimizer's groups. Each group's update is
``torch.optim.AdamW``'s (decoupled decay on every element of the group; Adam with L2 decay when
the config says ``adam_w_mode: false``), see :mod:`megazero.optim.adamw`.
"""

from __future__ import annotations

import torch

HPARAMS = ("lr", "betas", "eps", "weight_decay")


class EngineOptimizer(torch.optim.Optimizer):
    """User param groups over a :class:`~megazero.zero.ZeroOptimizer` (``zero``)."""

    def __init__(self, zero, groups: list[dict], defaults: dict):
        super().__init__(groups, defaults)
        self.zero = zero
        zero.set_param_groups([g["params"] for g in self.param_groups])
        self.last_grad_norm = None

    def hparams(self) -> list[dict]:
        """Every group's settings now (a scheduler may have changed ``lr``)."""
        return [{k: g[k] for k in HPARAMS if k in g} | {"use_muon": g.get("use_muon", False)}
                for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce what is pending, unscale, clip, Adam(W) per group, write back the parameters.
        Returns ``(stepped, grad_norm)``; ``stepped`` is False when fp16 overflowed (skipped)."""
        if closure is not None:
            raise ValueError("megazero's engine optimizer takes no closure (call engine.backward first)")
        ok, norm = self.zero.step(hparams=self.hparams())
        self.last_grad_norm = norm
        return ok, norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient accumulated since the last step."""
        self.zero.zero_grad()

    def state_dict(self):
        raise NotImplementedError("the engine optimizer's state is sharded over data-parallel ranks: "
                                  "use engine.save_checkpoint(dir, tag)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("the engine optimizer's state is sharded over data-parallel ranks: "
                                  "use engine.load_checkpoint(dir, tag)")
