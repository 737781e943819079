"""Dropout randomness for tensor parallelism, and activation recomputation that replays it.

An :class:`RNGTracker` owns two explicit ``torch.Generator`` objects (no global RNG state is
read or swapped):

* ``"replicated"`` -- seeded from (seed, ``stream``); identical on every rank of a TP group, so
  dropout on replicated activations (hidden dropout without sequence parallelism) draws the
  same mask on every TP rank, keeping the replicas identical;
* ``"tensor_parallel"`` -- seeded from (seed, ``stream``, tp_rank); different on every TP rank,
  for dropout on activations that are split across the group (attention probabilities of this
  rank's heads; every activation of a sequence-parallel region).

``stream`` tells model slices apart: the model passes its first global layer number, so every
pipeline stage and every virtual chunk on a rank draws independent masks. Seeds are hashed
(:func:`megazero.tensor_parallel.layers.init_seed`), so no two streams collide. Both generators
are the same across data-parallel replicas, as in Megatron-LM. :func:`dropout` draws its
mask from a named generator (``mask = U[0,1) >= p``, ``y = x * mask / (1 - p)``).

:func:`checkpoint` recomputes a function in the backward pass (``torch.utils.checkpoint``,
non-reentrant) after restoring the tracker's generators to their state at the original forward
call, so the recomputed dropout masks equal the original ones bit for bit; afterwards the
generators are put back where the forward pass left them. While the recomputation runs the
tracker's ``recomputing`` is True, so a layer can skip side effects that must happen once per
forward (the MoE router's metrics and expert-bias counts).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as torch_checkpoint

from .layers import init_seed

REPLICATED = "replicated"
TENSOR_PARALLEL = "tensor_parallel"


class RNGTracker:
    """Named generators on one device; an object owned by the model (never module state)."""

    def __init__(self, seed: int, tp_rank: int = 0, stream: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generators: dict[str, torch.Generator] = {}
        self.recomputing = False  # True while checkpoint() replays a forward in backward
        self.add(REPLICATED, init_seed(seed, f"dropout/{REPLICATED}/{stream}"))
        self.add(TENSOR_PARALLEL, init_seed(seed, f"dropout/{TENSOR_PARALLEL}/{stream}/{tp_rank}"))

    def add(self, name: str, seed: int) -> None:
        if name in self.generators:
            raise KeyError(f"generator {name!r} already exists")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.generators[name] = gen

    def get(self, name: str) -> torch.Generator:
        return self.generators[name]

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: gen.get_state() for name, gen in self.generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        for name, state in states.items():
            self.generators[name].set_state(state)

    # checkpoint save/load
    state_dict = get_states

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.set_states(states)


def dropout(x: torch.Tensor, p: float, training: bool, tracker: RNGTracker | None, name: str) -> torch.Tensor:
    """Inverted dropout with the mask drawn from ``tracker``'s generator ``name``."""
    if not training or p == 0.0:
        return x
    if tracker is None:
        raise ValueError("dropout with p > 0 in training needs an RNGTracker")
    keep = torch.rand(x.shape, generator=tracker.get(name), device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def checkpoint(fn, tracker: RNGTracker | None, *args):
    """``fn(*args)``, recomputed in backward with the same dropout masks (see module doc).

    Only the inputs are kept; the activations inside ``fn`` are recomputed when the gradient
    is needed. Outputs and gradients equal an un-checkpointed call exactly.
    """
    if tracker is None:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    forward_states = tracker.get_states()
    calls = [0]

    def run(*inner):
        calls[0] += 1
        if calls[0] == 1:  # the original forward
            return fn(*inner)
        after = tracker.get_states()
        tracker.set_states(forward_states)
        tracker.recomputing = True
        try:
            return fn(*inner)
        finally:
            tracker.set_states(after)
            tracker.recomputing = False

    return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)
