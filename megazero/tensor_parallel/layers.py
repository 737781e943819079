"""Tensor-parallel layers: column- and row-parallel linears, the vocab-parallel embedding.

With ``p`` TP ranks and this rank ``r``:

* :class:`ColumnParallelLinear` -- ``Y = X A^T + b`` with ``A`` split by output rows:
  rank ``r`` holds ``A_r`` (``[out/p, in]``) and computes ``Y_r = X A_r^T + b_r``. Input: ``f``
  (:func:`copy_to_tp_region`, bwd all-reduce of dX) or, with sequence parallelism, the all-gather
  of the ``[s/p, b, h]`` input along the sequence (bwd reduce-scatter of dX). ``gather_output``
  all-gathers ``Y`` along the last dim. ``partition_sizes`` splits the output rows into logical
  blocks (e.g. Q, K, V or gate, up) that are each split ``p`` ways, so rank ``r`` holds block
  ``r`` of every one of them, concatenated.
* :class:`RowParallelLinear` -- ``A`` split by input columns: rank ``r`` holds ``A_r``
  (``[out, in/p]``) and computes the partial ``X_r A_r^T``; ``g`` (:func:`reduce_from_tp_region`,
  all-reduce) sums the partials, or, with sequence parallelism, a reduce-scatter along the
  sequence. The bias is replicated and added after the reduction.
* :class:`VocabParallelEmbedding` -- the padded vocabulary ``V'`` is split in ``p`` contiguous
  ranges; rank ``r`` looks up the ids in its range (others give 0) and the partial rows are
  summed by ``g`` (or reduce-scattered along dim 0 with sequence parallelism).

Layout-independent initialization: every weight is first built whole (fp32, CPU) by
``init_method`` -- :func:`seeded_normal` draws it from a ``torch.Generator`` seeded by (seed,
key) -- then this rank's slice is kept, so TP = 1, 2, 4 start from the same model. Vocabulary
matrices are drawn for the real ``vocab_size`` rows and zero-padded, so the padding (which
depends on TP) doesn't change the real rows.

Deferred (meta-device) initialization: built with ``device="meta"`` a layer draws nothing; its
parameters are empty meta tensors of the TP-local shape, and ``param_inits[name]()`` returns the
value it would have drawn (fp32, CPU, TP-local). :func:`param_initializer` collects these over a
model, so ZeRO-3 can materialize one unit at a time straight into this rank's shard with the same
bits as an eager build (``init()`` is exactly what the eager build casts to ``params_dtype``).

Split backward (:mod:`.weight_grad_store`): every layer here has a ``weight_grad_store``
(None until ``WeightGradStore.attach``); while that store defers, the weight's gradient is
computed at the schedule's ``W`` instead of in the backward (the bias's stays in the backward).

Each layer converts its parameters between the full tensor and this rank's slice
(:meth:`full_to_local`, :meth:`local_to_full`, the latter a collective over the TP group); a
replicated parameter is its own full tensor. Replicated parameters that see sequence-split
activations (the row-parallel bias under sequence parallelism) pass through ``f`` so their
gradient is summed over the TP group inside autograd.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .spec import to_full, to_local, tp_split, unshard
from .wgrad_fusion import embedding as fused_embedding
from .wgrad_fusion import linear as fused_linear
from .mappings import (copy_to_tp_region, gather_from_sequence_parallel_region, gather_from_tp_region,
                       group_rank, group_size, reduce_from_tp_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tp_region)

InitMethod = Callable[[torch.Tensor], None]


def init_seed(seed: int, key: str) -> int:
    """A 63-bit generator seed from (seed, key), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal(std: float, seed: int, key: str) -> InitMethod:
    """Init method: ``t ~ N(0, std^2)`` drawn from a CPU generator seeded by ``init_seed(seed, key)``."""
    def init(t: torch.Tensor) -> None:
        gen = torch.Generator()
        gen.manual_seed(init_seed(seed, key))
        with torch.no_grad():
            t.normal_(0.0, std, generator=gen)
    return init


def gather_tensor(local: torch.Tensor, dim: int, group, partition_sizes=None) -> torch.Tensor:
    """All-gather every rank's slice and reassemble the full tensor (collective over ``group``)."""
    p = group_size(group)
    if p == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, dim, partition_sizes)


def default_device(group) -> torch.device:
    """CUDA's current device on an NCCL group, else CPU (the device follows the backend)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _full_weight(shape, init_method: InitMethod | None, real_rows: int | None) -> torch.Tensor:
    """Full fp32 weight: ``init_method`` on the real rows, zero padding rows after them."""
    rows = shape[0] if real_rows is None else real_rows
    full = torch.zeros(shape, dtype=torch.float32)
    # drawn in place: the first `rows` rows are contiguous, so the generator fills them exactly as
    # a fresh [rows, ...] tensor (no second fp32 copy of the largest weight)
    (init_method or seeded_normal(0.02, 0, "unnamed"))(full[:rows])
    return full


def param_initializer(roots) -> Callable[[torch.Tensor], torch.Tensor]:
    """``init(param)``: the initial value (fp32, CPU, this rank's TP-local shape) of any parameter
    under ``roots`` that a module declares in its ``param_inits`` dict ``{dotted name relative to
    the module: () -> tensor}``; ``KeyError`` for one no module declares. The ZeRO hook for
    materializing a model built on the meta device."""
    table = {}
    for root in roots:
        for module in root.modules():
            for name, fn in getattr(module, "param_inits", {}).items():
                table[id(module.get_parameter(name))] = fn

    def init(param: torch.Tensor) -> torch.Tensor:
        return table[id(param)]()
    return init


class TPLayer(nn.Module):
    """Conversion between full tensors and this rank's slices, by :mod:`.spec`'s rule."""

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return to_local(self, name, full, group_rank(self.tp_group), group_size(self.tp_group))

    def local_to_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return to_full(self, name, local, self.tp_group)

    def _make(self, name: str, full_shape, make_full: Callable[[], torch.Tensor], dtype, device) -> nn.Parameter:
        """Parameter ``name`` from ``make_full()`` (the fp32 full tensor of ``full_shape``), sliced
        for this rank; on the meta device only its local shape, the draw kept in ``param_inits``."""
        def init() -> torch.Tensor:
            full = make_full()
            return self.full_to_local(name, full) if name in self.partitions else full
        self.param_inits[name] = init
        if torch.device(device).type == "meta":
            split = tp_split(self, name)  # the local shape by arithmetic: no op on meta tensors
            shape = split.local_shape(full_shape, group_size(self.tp_group)) if split else tuple(full_shape)
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        return nn.Parameter(init().to(device=device, dtype=dtype))


class ColumnParallelLinear(TPLayer):
    """``Y = X A^T + b``, ``A`` split along its output rows (see module doc).

    Input ``[..., in]`` (``[s/p, b, in]`` with ``sequence_parallel``); output ``[..., out/p]``
    (or ``[..., out]`` with ``gather_output``). ``real_out_features`` (vocabulary heads) draws only
    that many rows and zero-pads to ``out_features``. ``forward(x, weight=None)`` may take an
    external weight of the local shape (tied output layer); ``skip_bias_add`` returns
    ``(Y without bias, b)`` (``b`` gathered too with ``gather_output``).
    """

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 partition_sizes=None, real_out_features: int | None = None, init_method: InitMethod | None = None,
                 params_dtype=torch.float32, device=None, create_weight: bool = True):
        super().__init__()
        self.tp_group, self.p = tp_group, group_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.p > 1
        self.partitions = {"weight": (0, partition_sizes, real_out_features),
                           "bias": (0, partition_sizes, real_out_features)}
        device = default_device(tp_group) if device is None else device
        self.param_inits = {}
        self.weight_grad_sink = None  # gradient accumulation fusion: accumulate_weight_grad_into
        self.weight_grad_store = None  # split backward: WeightGradStore.attach (.weight_grad_store)
        shape = (out_features, in_features)
        if create_weight:
            self.weight = self._make("weight", shape, lambda: _full_weight(shape, init_method, real_out_features),
                                     params_dtype, device)
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = self._make("bias", (out_features,), lambda: torch.zeros(out_features), params_dtype, device)
        else:
            self.register_parameter("bias", None)

    def accumulate_weight_grad_into(self, sink) -> None:
        """Gradient accumulation fusion (:mod:`.wgrad_fusion`): the weight gradient goes to
        ``sink(weight, G, X)`` (the optimizer's fp32 flat gradient); None: off."""
        self.weight_grad_sink = sink

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tp_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        y = fused_linear(x, weight, bias, self.weight_grad_sink, self.weight_grad_store)
        if not self.gather_output:
            return (y, self.bias) if self.skip_bias_add else y
        y = gather_from_tp_region(y, self.tp_group)
        if not self.skip_bias_add:
            return y
        return y, None if self.bias is None else gather_from_tp_region(self.bias, self.tp_group)


class RowParallelLinear(TPLayer):
    """``Y = X A^T + b``, ``A`` split along its input columns (see module doc).

    Input ``[..., in/p]`` (``input_is_parallel``) or ``[..., in]`` (then split here); output
    ``[..., out]`` (``[s/p, b, out]`` with ``sequence_parallel``, which needs ``input_is_parallel``).
    """

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.p = tp_group, group_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.p > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        self.partitions = {"weight": (1, None, None)}
        device = default_device(tp_group) if device is None else device
        self.param_inits = {}
        self.weight_grad_store = None  # split backward: WeightGradStore.attach (.weight_grad_store)
        shape = (out_features, in_features)
        self.weight = self._make("weight", shape, lambda: _full_weight(shape, init_method, None), params_dtype, device)
        if bias:
            self.bias = self._make("bias", (out_features,), lambda: torch.zeros(out_features), params_dtype, device)
        else:
            self.register_parameter("bias", None)

    def _bias(self):
        if self.bias is None or not self.sequence_parallel:
            return self.bias
        return copy_to_tp_region(self.bias, self.tp_group)  # replicated over split activations

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        y = fused_linear(x, self.weight, None, None, self.weight_grad_store)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        bias = self._bias()
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias


class VocabParallelEmbedding(TPLayer):
    """Embedding of ``num_embeddings`` (padded) rows split in ``p`` contiguous vocabulary ranges.

    ``forward(ids)``: ids of any shape -> ``ids.shape + (dim,)``. Rank ``r`` owns ids in
    ``[r V'/p, (r+1) V'/p)``; the others look up row 0 and are zeroed, then the partial results
    are summed by all-reduce, or with ``sequence_parallel`` reduce-scattered along dim 0 (so the
    caller passes ``[s, b]`` ids and gets ``[s/p, b, h]``). Only the first ``vocab_size`` rows are
    drawn by ``init_method``; padding rows are zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group, *, vocab_size: int | None = None,
                 sequence_parallel: bool = False, init_method: InitMethod | None = None,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.p = tp_group, group_size(tp_group)
        if num_embeddings % self.p:
            raise ValueError(f"padded vocabulary {num_embeddings} is not divisible by the TP size {self.p}")
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        if self.vocab_size > num_embeddings:
            raise ValueError(f"vocab_size {self.vocab_size} exceeds padded size {num_embeddings}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel and self.p > 1
        per_rank = num_embeddings // self.p
        self.vocab_start = group_rank(tp_group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.partitions = {"weight": (0, None, self.vocab_size)}
        device = default_device(tp_group) if device is None else device
        self.param_inits = {}
        self.weight_grad_sink = None  # gradient accumulation fusion: accumulate_weight_grad_into
        self.weight_grad_store = None  # split backward: WeightGradStore.attach (.weight_grad_store)
        shape = (num_embeddings, embedding_dim)
        self.weight = self._make("weight", shape, lambda: _full_weight(shape, init_method, self.vocab_size),
                                 params_dtype, device)

    def accumulate_weight_grad_into(self, sink) -> None:
        """Gradient accumulation fusion (:mod:`.wgrad_fusion`): the table's gradient rows go to
        ``sink(weight, ids, G)`` (the optimizer's fp32 flat gradient); None: off."""
        self.weight_grad_sink = sink

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.p == 1:
            return fused_embedding(ids, self.weight, self.weight_grad_sink, self.weight_grad_store)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = fused_embedding(local, self.weight, self.weight_grad_sink, self.weight_grad_store).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tp_region(out, self.tp_group)
