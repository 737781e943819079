"""The random-number state a checkpoint saves under ``rng`` and an exact resume restores.

``rng_state(rng_states)`` returns plain values and tensors only (``weights_only``-loadable)::

    {"python": [624 words], "python_pos": int,          # random.getstate()
     "numpy_keys": int64 tensor [624], "numpy_pos": int,  # np.random.get_state() (MT19937)
     "torch": uint8 tensor,                               # torch.get_rng_state()
     "cuda": uint8 tensor,                                # only when CUDA is available
     "trackers": [state_dict() of each object in rng_states]}   # e.g. each chunk's dropout tracker

``rng_states`` is :attr:`ModelStages.rng_states`: objects with ``state_dict()`` /
``load_state_dict()``, one per model chunk.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(rng_states) -> dict:
    """Every RNG this rank draws from (see the module doc)."""
    np_state = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
             "torch": torch.get_rng_state(),
             "trackers": [r.state_dict() for r in rng_states]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, rng_states) -> None:
    """Inverse of :func:`rng_state` (the CUDA state only when CUDA is available)."""
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for r, tracker_state in zip(rng_states, state["trackers"]):
        r.load_state_dict(tracker_state)
