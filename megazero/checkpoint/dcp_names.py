"""The tensors of a ``--ckpt-format torch_dcp`` checkpoint: names and rectangular pieces.

A DCP checkpoint stores each named tensor at its full shape, as rectangular chunks
(``offsets``, ``sizes``) written by whichever ranks hold them. The names are Hugging Face
``transformers``' (``LlamaForCausalLM`` / ``GPT2LMHeadModel`` / ``Qwen2ForCausalLM``, the mapping of
:mod:`megazero.checkpoint.convert.hf`): the fused ``attention.qkv`` of megazero becomes
``q_proj`` / ``k_proj`` / ``v_proj`` and a SwiGLU ``fc1`` ``gate_proj`` / ``up_proj``, GPT-2's
``Conv1D`` matrices are stored transposed, ``--apply-layernorm-1p`` norms as HF's ``1 + w``; a
tied output layer is left out (as in ``tools/convert_checkpoint.py to-fp32``).

The mapping needs no gather: a TP rank holds block ``t`` of every logical block of a split
parameter (``tensor_parallel/spec.py``), which is one contiguous range of rows (or columns) of
that block, so each rank's TP-local tensor is cut into one rectangle per block, placed in the HF
tensor the block maps to; padding rows of a vocabulary matrix are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.checkpoint.convert.hf import arch_of_config, hf_to_full, name_map


@dataclass(frozen=True)
class Piece:
    """One rectangle of the HF tensor ``fqn`` (full shape ``size``) at ``offsets``."""

    fqn: str
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    tensor: torch.Tensor


def full_shape(local_shape, split, tp: int) -> list[int]:
    """The full (unpadded) shape of a parameter whose TP-local shape is ``local_shape``."""
    shape = list(local_shape)
    if split is not None:
        shape[split.dim] = split.real_rows if split.real_rows is not None else shape[split.dim] * tp
    return shape


def _blocks(piece: torch.Tensor, roff: tuple, local_shape, split, tp_rank: int, tp: int):
    """``(block, block start, block length, offsets, part)``: the part of ``piece`` (the
    rectangle of this TP rank's tensor at ``roff``) in each logical block, ``offsets`` in the full
    tensor's coordinates with the split dimension counted from the block's start."""
    if split is None:
        yield 0, 0, None, tuple(roff), piece
        return
    dim = split.dim
    sizes = list(split.partition_sizes) if split.partition_sizes else [local_shape[dim] * tp]
    start = lo = 0
    for b, n in enumerate(sizes):
        m = n // tp
        x0, x1 = max(lo, roff[dim]), min(lo + m, roff[dim] + piece.shape[dim])
        within = tp_rank * m + x0 - lo
        if split.real_rows is not None:  # a vocabulary matrix: padding rows past real_rows dropped
            x1 = min(x1, x0 + split.real_rows - within)
        if x1 > x0:
            offsets = list(roff)
            offsets[dim] = within
            yield b, start, split.real_rows or n, tuple(offsets), piece.narrow(dim, x0 - roff[dim], x1 - x0)
        start, lo = start + n, lo + m


def model_pieces(name: str, piece: torch.Tensor, config, *, split, tp_rank: int, tp: int, local_shape,
                 roff=None, prefix: str = "", suffix: str = "", shift: bool = True) -> list[Piece]:
    """The HF-named rectangles ``prefix + fqn + suffix`` of megazero parameter ``name`` that
    ``piece`` (the rectangle at ``roff`` of TP rank ``tp_rank``'s tensor of ``local_shape``)
    holds, fp32; ``shift``: an ``--apply-layernorm-1p`` norm weight stored as HF's ``1 + w``."""
    targets = name_map(arch_of_config(config), config)[name]
    full = full_shape(local_shape, split, tp)
    roff = tuple(roff) if roff is not None else (0,) * piece.dim()
    out = []
    for b, start, length, offsets, part in _blocks(piece.detach().float(), roff, local_shape, split, tp_rank, tp):
        fqn, transpose = targets[b] if len(targets) > 1 else targets[0]
        offsets, size = list(offsets), list(full)
        if split is not None and len(targets) > 1:
            size[split.dim] = length
        elif split is not None:
            offsets[split.dim] += start
        if shift and config.apply_layernorm_1p and name.endswith("norm.weight"):
            part = part + 1
        if transpose:
            part, offsets, size = part.t(), offsets[::-1], size[::-1]
        out.append(Piece(prefix + fqn + suffix, tuple(offsets), tuple(size), part.contiguous()))
    return out


def flat_rectangles(shape, a: int, b: int):
    """``[(offsets, sizes, k0, k1)]``: the elements ``[a, b)`` of a flat tensor of ``shape``
    (at most 2-D) as rectangles, each the flat elements ``[k0, k1)``: a partial first row, whole
    rows, a partial last row."""
    if len(shape) < 2:
        return [((a,) if shape else (), (b - a,) if shape else (), a, b)] if b > a else []
    if len(shape) > 2:
        raise ValueError(f"a {len(shape)}-D parameter has no rectangle split here")
    cols, out, k = shape[1], [], a
    while k < b:
        row, col = divmod(k, cols)
        if col or b - k < cols:  # a partial row
            end = min(b, (row + 1) * cols)
            out.append(((row, col), (1, end - k), k, end))
        else:
            rows = (b - k) // cols
            end = k + rows * cols
            out.append(((row, 0), (rows, cols), k, end))
        k = end
    return out


def hf_sources(name: str, config) -> list[str]:
    """The HF tensors megazero parameter ``name`` is built from."""
    return [src for src, _ in name_map(arch_of_config(config), config)[name]]


def full_from_hf(name: str, hf_tensors: dict, config) -> torch.Tensor:
    """megazero's full tensor ``name`` (a canonical name, not a tied copy) from its HF tensors
    (:func:`hf_sources`)."""
    return hf_to_full(hf_tensors, config, arch_of_config(config))[name]
