"""Muon (momentum orthogonalized by Newton-Schulz) on whole matrices: the math only.

For a 2-D hidden matrix W with gradient G, momentum buffer B (zero at start), momentum mu::

    (L2 decay, decoupled=False:  G <- G + wd W)
    B <- B + (1 - mu) (G - B)                       (lerp: torch.optim.Muon, Megatron, DeepSpeed)
    U <- G + mu (B - G)  if nesterov  else  B
    O <- NS_k(U)                                    (k Newton-Schulz steps, below)
    W <- W (1 - lr wd)  - lr * s(rows, cols) * O    (decoupled decay with the unscaled lr)

Everything before NS is elementwise (ZeRO keeps momentum sharded and runs it on shards); only NS
needs the whole matrix. NS (quintic): X = U / ||U||_F (transposed so rows <= cols), then per
step with coefficients (a, b, c): ``A = X X^T; X <- a X + (b A + c A A) X``. Three flavours,
each the reference's own arithmetic (dtype, where the norm is taken, op order), so a one-process
run equals the reference to its rounding:

* ``torch`` (torch 2.13 ``torch.optim.Muon``): cast to bf16, divide by ``max(||X||, 1e-7)`` in
  bf16, ``addmm`` steps with fixed (3.4445, -4.7750, 2.0315);
* ``megatron`` (emerging_optimizers ``newton_schulz``, used by Megatron-LM's ``--optimizer
  muon``): normalize in fp32 (``F.normalize``, eps 1e-15), then bf16 when
  ``--muon-fp32-matmul-prec medium`` (the default) or fp32 (``high``), ``addmm`` steps with the
  coefficient schedule ``--muon-coefficient-type`` (cycled; ``repeat_last`` for polar_express,
  cans, deepseekv4);
* ``deepspeed`` (DeepSpeed 0.19.8 ``zeropower_via_newtonschulz5``, ``ns_method: standard``):
  bf16, ``X / (||X|| + 1e-7)``, ``b * A + c * A @ A`` written out, the scale applied in bf16;
* ``deepspeed_gram`` (DeepSpeed 0.19.8 ``zeropower_via_gram_newtonschulz``, its default
  ``ns_method: gram``): the same polynomial iterated on the Gram matrix R = X X^T (Q accumulates
  the left factor, X <- Q X at the restart after step 2 and at the end), normalized in fp32, run in
  fp16 where the device has fp16 matmuls (a GPU; a CPU with oneDNN fp16), else fp32
  (``ns_dtype=None`` chooses so, as DeepSpeed's ``ns_compute_dtype``); square matrices take the
  plain iteration.

Scale s(rows, cols) of the update (rows = output dim): torch's ``adjust_lr_fn`` ``original``
(default) = Megatron's ``shape_scaling`` = DeepSpeed's = sqrt(max(1, rows/cols));
``match_rms_adamw`` = 0.2 sqrt(max(rows, cols)); Megatron's ``spectral`` (its default) =
sqrt(max(rows, cols)), ``unit_rms_norm`` = sqrt(rows/cols); times ``extra_scale``
(``--muon-extra-scale-factor``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# emerging_optimizers muon_utils.py (NVIDIA-NeMo/Emerging-Optimizers fd77292): Megatron's
# --muon-coefficient-type names; "simple" is torch.optim.Muon's and DeepSpeed's fixed triple
COEFFICIENTS = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
FLAVOURS = ("torch", "megatron", "deepspeed", "deepspeed_gram")
SCALE_MODES = ("original", "match_rms_adamw", "shape_scaling", "spectral", "unit_rms_norm")


@dataclass(frozen=True)
class MuonSettings:
    """One Muon configuration (see the module docstring). ``ns_dtype``: the NS matmul dtype
    (bf16 for torch/DeepSpeed and Megatron's ``medium``; fp32 for Megatron's ``high``)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficient_type: str = "simple"
    flavour: str = "torch"
    ns_dtype: torch.dtype = torch.bfloat16
    scale_mode: str = "original"
    extra_scale: float = 1.0
    split_qkv: bool = False
    decoupled: bool = True

    def __post_init__(self):
        if int(self.ns_steps) < 1:
            raise ValueError(f"Muon needs at least one Newton-Schulz step, got {self.ns_steps}")
        if self.coefficient_type not in COEFFICIENTS:
            raise ValueError(f"unknown Muon coefficient type {self.coefficient_type!r}; one of {sorted(COEFFICIENTS)}")
        if self.flavour not in FLAVOURS:
            raise ValueError(f"unknown Newton-Schulz flavour {self.flavour!r}; one of {FLAVOURS}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"unknown Muon scale mode {self.scale_mode!r}; one of {SCALE_MODES}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {self.momentum}")


def coefficients(settings: MuonSettings):
    """The (a, b, c) of each of the ``ns_steps`` steps (cycled, or the last repeated)."""
    sets = COEFFICIENTS[settings.coefficient_type]
    if settings.coefficient_type in REPEAT_LAST:
        it = itertools.chain(sets, itertools.repeat(sets[-1]))
    else:
        it = itertools.cycle(sets)
    return list(itertools.islice(it, int(settings.ns_steps)))


def scale_factor(rows: int, cols: int, settings: MuonSettings) -> float:
    """s(rows, cols) x ``extra_scale`` (module docstring)."""
    mode = settings.scale_mode
    if mode in ("original", "shape_scaling"):
        s = math.sqrt(max(1.0, rows / cols))
    elif mode == "match_rms_adamw":
        s = 0.2 * math.sqrt(max(rows, cols))
    elif mode == "spectral":
        s = math.sqrt(max(rows, cols))
    else:
        s = math.sqrt(rows / cols)
    return s * settings.extra_scale


def gram_dtype(device) -> torch.dtype:
    """DeepSpeed's ``ns_compute_dtype("gram")``: fp16 where supported (CUDA; oneDNN on a CPU), else fp32."""
    if torch.device(device).type == "cuda" or torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return torch.float16
    return torch.float32


def _gram_newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """DeepSpeed's Gram Newton-Schulz (``deepspeed_gram`` flavour, fixed coefficients), in its op order."""
    a, b, c = COEFFICIENTS["simple"][0]
    dtype = gram_dtype(u.device)
    flip = u.size(0) > u.size(1)
    x = (u.float() if u.dtype == torch.float16 else u)
    x = x.mT if flip else x
    n, m = x.shape
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if m <= n:
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.mT if flip else x
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == 2:  # DeepSpeed's restart
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != 2:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return x.mT @ q.mT if flip else q @ x


def newton_schulz(u: torch.Tensor, settings: MuonSettings) -> torch.Tensor:
    """NS_k(U) for a 2-D ``u`` in the settings' flavour; returned in fp32, unscaled."""
    if settings.flavour == "deepspeed_gram":
        return _gram_newton_schulz(u, int(settings.ns_steps)).float().contiguous()
    flip = u.size(0) > u.size(1)
    if settings.flavour == "megatron":
        x = u.float().mT if flip else u.float()
        x = F.normalize(x, p=2, dim=(-2, -1), eps=1e-15).to(settings.ns_dtype)
    else:
        x = u.to(settings.ns_dtype)
        x = x.mT if flip else x
        if settings.flavour == "torch":
            x = x.div(x.norm().clamp(min=1e-7))
        else:
            x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in coefficients(settings):
        gram = x @ x.mT
        if settings.flavour == "deepspeed":
            x = a * x + (b * gram + c * gram @ gram) @ x
        else:
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if flip else x).float().contiguous()


def orthogonalize(u: torch.Tensor, settings: MuonSettings, row_blocks=None) -> torch.Tensor:
    """The scaled update s * NS(U) of a whole 2-D matrix, fp32. ``row_blocks``: sizes of row
    blocks orthogonalized one by one (Megatron's ``--muon-split-qkv``: Q, K, V; each block's
    own shape gives its scale, as Megatron calls its orthogonalize per block)."""
    if row_blocks:
        return torch.cat([orthogonalize(part, settings) for part in u.split(list(row_blocks), dim=0)], dim=0)
    s = scale_factor(u.size(0), u.size(1), settings)
    o = newton_schulz(u, settings)
    if settings.flavour == "deepspeed":  # DeepSpeed scales in the NS dtype, then casts
        return (o.to(settings.ns_dtype) * s).float()
    if settings.flavour == "deepspeed_gram":
        return (o.to(gram_dtype(u.device)) * s).float()
    return o * s


def momentum_input(grads, bufs, params, settings: MuonSettings, weight_decay: float) -> list:
    """Elementwise part, on any matching pieces (shards) of gradients, momentum and weights:
    (L2 decay into G,) the momentum lerp in place, and the NS input U per piece (new tensors
    with Nesterov, else the buffers themselves)."""
    if not settings.decoupled and weight_decay:
        grads = [g.add(p, alpha=weight_decay) for g, p in zip(grads, params)]
    for b, g in zip(bufs, grads):  # per tensor: torch.optim.Muon's and DeepSpeed's own op (foreach's lerp rounds apart)
        b.lerp_(g, 1.0 - settings.momentum)
    if settings.nesterov:
        return [g.lerp(b, settings.momentum) for g, b in zip(grads, bufs)]
    return list(bufs)


def apply_update(params, updates, lr: float, weight_decay: float, decoupled: bool = True) -> None:
    """W <- W (1 - lr wd) - lr O on matching pieces (elementwise; L2 decay already in G)."""
    if weight_decay and decoupled:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


def muon_step(params, grads, bufs, settings: MuonSettings, *, lr: float, weight_decay: float,
              row_blocks=None) -> None:
    """One Muon step of whole 2-D matrices in one process (the reference shape: what
    ``torch.optim.Muon.step`` does to its parameters). ``row_blocks``: per matrix, or None."""
    row_blocks = row_blocks or [None] * len(params)
    us = momentum_input(grads, bufs, params, settings, weight_decay)
    updates = [orthogonalize(u, settings, rb) for u, rb in zip(us, row_blocks)]
    apply_update(params, updates, lr, weight_decay, settings.decoupled)
