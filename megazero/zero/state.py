"""What a checkpoint reads from and writes into a :class:`~.optimizer.ZeroOptimizer`: the
counters, this rank's shards and the self-description of the flat regions.

Per region (a flat span of parameters; see :mod:`.region`) with DP size N: this rank holds
``[shard_lo, shard_lo + shard_len)`` of the fp32 master and Adam moments (the whole region at
stage 0), and at stage 3 also of the parameters themselves (``param_shards``). Loading writes
those shards and then the parameters from the masters (``write_back``), exactly as after a step.
Nothing here gathers a stage-3 unit.
"""

from __future__ import annotations

import torch


class ShardState:
    """Mixed into :class:`~.optimizer.ZeroOptimizer` (uses its ``regions``, ``scaler`` and counters)."""

    def state_dict(self, shards: bool = True, copy: bool = True) -> dict:
        """Counters and (``shards``) this rank's fp32 master/moment shards per region: copies, or
        the live tensors with ``copy=False`` (a synchronous save writes them as they are)."""
        return {"iteration": self.iteration, "scaler": self.scaler.state_dict(),
                "skipped_iterations": self.skipped_iterations, "nan_iterations": self.nan_iterations,
                "shards": [r.shard_state(copy) for r in self.regions] if shards else []}

    def param_shards(self, copy: bool = True) -> list:
        """Stage 3: per region this rank's parameter shard (params dtype, ``[shard_lo, shard_lo +
        shard_len)`` of the flat region; a copy unless ``copy=False``), None for a region kept
        whole. Nothing is gathered."""
        return [(r.param_shard.clone() if copy else r.param_shard) if r.partitioned else None for r in self.regions]

    @torch.no_grad()
    def load_param_ranges(self, fetch, kinds=("master", "exp_avg", "exp_avg_sq")) -> None:
        """Fill every region's shard from ``fetch(param, kind, a, b)`` (elements ``[a, b)`` of the
        parameter's flat TP-local tensor; only the part inside this rank's shard is asked for),
        then write the parameters back. See :meth:`Region.load_ranges`. Collective."""
        for r in self.regions:
            r.load_ranges(fetch, kinds)
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()

    def load_counters(self, sd: dict) -> None:
        """Step count, loss scaler and skip counters of a :meth:`state_dict` (layout-free)."""
        self.iteration = sd["iteration"]
        self.scaler.load_state_dict(sd["scaler"])
        self.skipped_iterations, self.nan_iterations = sd["skipped_iterations"], sd["nan_iterations"]

    def load_state_dict(self, sd: dict) -> None:
        self.load_counters(sd)
        for r, s in zip(self.regions, sd["shards"]):
            r.load_shard_state(s)
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()

    def layout(self, name_of: dict) -> list[dict]:
        """Self-description of the flat regions, for checkpoints: per region the ordered
        ``[name, offset, numel]`` of its parameters (``name_of``: id(param) -> name), its
        ``padded`` length and this rank's shard ``[shard_lo, shard_lo + shard_len)``."""
        return [r.describe(name_of) for r in self.regions]

    @torch.no_grad()
    def load_param_states(self, states_of) -> None:
        """Set master weights and both Adam moments per parameter, then write the parameters back.

        ``states_of(param)`` returns ``{"master", "exp_avg", "exp_avg_sq"}``: fp32 tensors of the
        parameter's (TP-local) shape; only the part inside this rank's shard is copied:
        ``shard[a - lo : b - lo] = state.flat[a - o : b - o]`` with ``[a, b)`` the overlap of
        ``[o, o + numel)`` and ``[lo, lo + len)``.  Collective (the write-back all-gathers)."""
        for r in self.regions:
            r.load_param_states(states_of)
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()
