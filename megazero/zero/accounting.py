"""What a :class:`~.optimizer.ZeroOptimizer` holds and moved: model-state bytes against the ZeRO
paper's formula, and the last step's communication as TensorBoard scalars."""

from __future__ import annotations

from collections import defaultdict

import torch


class StateAccounting:
    """Mixed into :class:`~.optimizer.ZeroOptimizer` (uses its ``regions``, ``stage``, ``phi``,
    ``topo``, ``params_dtype``, ``grad_dtype`` and ``last_comm``)."""

    def state_bytes(self) -> dict:
        """Model-state bytes on this rank and the ZeRO paper's formula for this stage, with p/g the
        parameter/gradient bytes, Φ the parameters and N the DP size: stage 0 ``(p+g+12)Φ``,
        1 ``(p+g)Φ + 12Φ/N``, 2 ``pΦ + (g+12)Φ/N``, 3 ``(p+g+12)Φ/N``."""
        tot = defaultdict(int)
        for r in self.regions:
            for k, v in r.state_bytes().items():
                tot[k] += v
        tot = dict(tot, total=sum(tot.values()))
        p = torch.empty((), dtype=self.params_dtype).element_size()
        g = torch.empty((), dtype=self.grad_dtype).element_size()
        phi, n = self.phi, self.topo.dp_cp
        formula = [(p + g + 12) * phi, (p + g) * phi + 12 * phi / n, p * phi + (g + 12) * phi / n,
                   (p + g + 12) * phi / n][self.stage]
        return dict(tot, formula=formula, phi=phi, dp=n, param_bytes=p, grad_bytes=g)

    def comm_scalars(self) -> dict:
        """TensorBoard scalars of the last step's accounting."""
        c = self.last_comm
        if not c:
            return {}
        return {"zero/comm-multiple": c["dp_logical_multiple"], "zero/primitive-multiple": c["dp_primitive_multiple"],
                "zero/state-bytes": float(self.state_bytes()["total"])}
