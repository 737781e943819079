"""``torch.load(weights_only=True)`` of one Megatron-LM ``model_optim_rng.pt``.

A Megatron-LM rank file pickles more than tensors. Checked by pickling what megatron-core 0.16.1
with Megatron-LM ``core_v0.16.1``'s training code really stores (``generate_state_dict`` and
``get_rng_state`` in ``megatron/training/checkpointing.py``, the parsed and validated ``args`` of
``megatron/training/arguments.py``), ``torch.serialization.get_unsafe_globals_in_checkpoint``
lists:

* ``argparse.Namespace`` (``args``), ``signal.Signals`` (``args.exit_signal``, a
  ``TrainingConfig`` field typed ``signal.Signals`` since 0.16), Megatron enums such as
  ``megatron.core.transformer.enums.AttnBackend`` (``args.attention_backend``);
* ``numpy.ndarray``, ``numpy.dtype``, ``numpy._core.multiarray._reconstruct`` (numpy 2;
  ``numpy.core.multiarray._reconstruct`` under numpy 1): ``rng_state[i]["np_rng_state"]``, the
  tuple of ``np.random.get_state()``.

Megatron loads its own files under the allow-list ``megatron/core/safe_globals.py``
(``SAFE_GLOBALS``, megatron-core 0.16.1); megazero allows the same non-Megatron classes
(:data:`ALLOWED`, those above plus ``types.SimpleNamespace``, ``pathlib.PosixPath``,
``io.BytesIO`` and numpy's ``UInt32DType``), and classes of ``megatron.*`` /
``transformer_engine.*`` load as inert :class:`_Opaque` objects (megazero reads only the
weights and plain ``args`` values, so Megatron need not be installed). Any other global is
refused with the file and the names.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import signal
import types

import numpy as np
import torch

from megazero.checkpoint.schema import CheckpointError

__all__ = ["ALLOWED", "load_megatron_file"]


def _numpy_globals() -> dict:
    """numpy's pickling helpers under the names numpy 1 and numpy 2 pickle them with."""
    out = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own _reconstruct, whichever module
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{module}._reconstruct"] = reconstruct
    uint32 = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
    if uint32 is not None:
        out["numpy.dtypes.UInt32DType"] = uint32
    return out


# the non-Megatron entries of megatron/core/safe_globals.py SAFE_GLOBALS (megatron-core 0.16.1)
ALLOWED = {"argparse.Namespace": argparse.Namespace, "signal.Signals": signal.Signals,
           "types.SimpleNamespace": types.SimpleNamespace, "pathlib.PosixPath": pathlib.PosixPath,
           "_io.BytesIO": io.BytesIO, **_numpy_globals()}
OPAQUE_PREFIXES = ("megatron.", "transformer_engine.")


class _Opaque:
    """Stands in for a Megatron class in ``args`` (an enum, a config object) when loading."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def load_megatron_file(path: str) -> dict:
    """The rank file ``path`` loaded with ``weights_only=True`` and the module doc's allow-list;
    raises :class:`CheckpointError` naming any other global (nothing of it is run)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals
    try:
        unsafe = get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign file
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    # all of ALLOWED at once: numpy's dtype builds UInt32DType while loading without listing it
    allow, refused = [(obj, name) for name, obj in ALLOWED.items()], []
    for name in unsafe:
        if name in ALLOWED:
            continue
        if name.startswith(OPAQUE_PREFIXES):
            allow.append((_Opaque, name))
        else:
            refused.append(name)
    if refused:
        raise CheckpointError(f"{path}: refusing to unpickle {refused} (a Megatron-LM checkpoint holds only "
                              "tensors, argparse/signal/numpy values and Megatron classes)")
    with safe_globals(allow):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
