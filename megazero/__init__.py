"""megazero: 3D-parallel GPT pretraining (tensor, interleaved pipeline and ZeRO 0-3 data
parallelism) over one explicit process-group topology, and ``megazero.initialize`` (DeepSpeed's
API) for any ``torch.nn.Module``. See README.md and docs/."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` for any module: see :func:`megazero.engine.initialize`."""
    from megazero.engine import initialize as _initialize
    return _initialize(*args, **kwargs)


def load_model(path: str, device="cpu", dtype=None, iteration=None):
    """A megazero checkpoint saved at any layout as one ``nn.Module`` giving logits over the real
    vocabulary: see :func:`megazero.inference.load_model.load_model`."""
    from megazero.inference.load_model import load_model as _load_model
    return _load_model(path, device=device, dtype=dtype, iteration=iteration)
