"""A region: one flat span of parameters (one dtype, one model chunk) with its gradient and its
optimizer shard.  Stages 0-2 cut the model into regions of ``--zero-reduce-bucket-size`` elements
(the buckets, in reverse execution order); stage 3 makes one region per unit (a layer).

Layout, with N = DP size and L = real elements of the region::

    padded = ceil(L / N) * N          (stage 0: padded = L, nothing is sharded)
    shard  = [dp_rank * padded/N, (dp_rank + 1) * padded/N)

What a region keeps per rank (params_dtype p bytes, grad dtype g bytes; padding aside):

=========================  ============  =================  ================================
                           parameters    gradients          fp32 master + Adam m, v
=========================  ============  =================  ================================
stage 0                    L p           L g                12 L
stage 1 (flush after M)    L p           L g                12 L / N
stage 2 (flush each mb)    L p           L g / N            12 L / N
stage 3, partitioned       L p / N       L g / N            12 L / N
=========================  ============  =================  ================================

Gradients land in ``full_grad`` (post-accumulate-grad hook adds ``p.grad`` in and drops it).  A
round is complete when every parameter of the region has had ``flush_every`` accumulations
(M for stages 0/1, 1 for stage 2/3); then the region is *flushed*: all-reduced over DP (stage 0,
volume 2L) or reduce-scattered into ``grad_shard`` (stages 1-3, volume L; added to what earlier
micro-batches left there).
"""

from __future__ import annotations

import torch

from .collectives import UNIT_GATHER_ELEMS, Collectives, Pending


def _merge(segments):
    out = []
    for a, b in segments:
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _initial_value(param_init, p: torch.Tensor) -> torch.Tensor:
    """``param_init(p)`` for a meta parameter, checked against its shape."""
    if param_init is None:
        raise ValueError("a parameter is on the meta device but no param_init was given to materialize it")
    value = param_init(p)
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"param_init gave shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}")
    return value


class Region:
    """Flat parameters, gradients and the optimizer shard of a list of same-dtype parameters.

    ``counted[i]``: whether parameter i's gradient enters the global norm on this rank (False for
    a TP-duplicated parameter off TP rank 0, or a tied copy off the tie group's first rank).
    ``shared``: name of a group over which the full gradient is summed before DP reduction
    (tied weights across pipeline stages); such a region is flushed only in ``finish``.
    ``group``: the :class:`Collectives` group it reduces over and shards across (``dp``; an MoE
    model's routed experts: ``edp``, the expert-data-parallel ranks holding the same experts).
    """

    def __init__(self, params, counted, *, comm: Collectives, dp_size: int, dp_rank: int, stage: int,
                 partitioned: bool, flush_every: int, keep_full_grad: bool, grad_dtype: torch.dtype,
                 shared: str | None = None, chunk: int = 0, param_init=None, device=None, group: str = "dp"):
        self.comm, self.stage, self.partitioned, self.shared, self.chunk = comm, stage, partitioned, shared, chunk
        self.group = group
        self.flush_every = flush_every
        self.params = list(params)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"a region holds one dtype, got {dtypes}")
        self.dtype = dtypes.pop()
        self.grad_dtype = grad_dtype
        device = self.params[0].device if device is None else torch.device(device)
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        n = dp_size if stage >= 1 else 1
        self.padded = -(-off // n) * n
        self.shard_len = self.padded // n
        self.shard_lo = (dp_rank if stage >= 1 else 0) * self.shard_len
        self.counts_in_world = stage >= 1 or dp_rank == 0  # a world norm sum: stage 0's first replica only

        # parameters: views of one flat buffer (released between uses when partitioned); a meta
        # parameter is materialized here, one at a time, from param_init (so a partitioned
        # region holds at most its own full parameters, and only until release() below)
        self.param_flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
        for p, o in zip(self.params, self.offsets):
            view = self.param_flat[o:o + p.numel()].view(p.shape)
            if p.is_meta:  # .data cannot leave the meta device: swap in an empty real tensor first
                view.copy_(_initial_value(param_init, p))
                torch.utils.swap_tensors(p, torch.nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad))
            else:
                view.copy_(p.detach())
            p.data = view  # (keeps the parameter's own version counter: gathers into the buffer are not edits)
        shard = self.param_flat[self.shard_lo:self.shard_lo + self.shard_len]
        self.master = shard.to(torch.float32, copy=True)  # one fp32 allocation (float().clone() made two)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.param_shard = None
        self.gathered = True
        if partitioned:
            self.param_shard = shard.clone()
            self.release()

        # gradients
        self.persistent_grad = keep_full_grad or stage == 0
        self.full_grad = torch.zeros(self.padded, dtype=grad_dtype, device=device) if self.persistent_grad else None
        self.grad_shard = self.full_grad if stage == 0 else torch.zeros(self.shard_len, dtype=grad_dtype, device=device)
        self.fresh = True  # grad_shard holds nothing yet this step
        self.counts = [0] * len(self.params)
        self.complete = 0
        self.dirty = False  # gradient added since the last flush

        # shard segments (relative to the shard) for weight decay and the global norm
        lo, hi = self.shard_lo, self.shard_lo + self.shard_len
        seg = [(max(o, lo) - lo, min(o + p.numel(), hi) - lo) for p, o in zip(self.params, self.offsets)]
        self.decay_segments = _merge(s for s, p in zip(seg, self.params) if p.dim() >= 2)
        self.norm_segments = _merge(s for s, c in zip(seg, counted) if c)

    # ---- gradients -------------------------------------------------------------------------
    def _grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece of the flat gradient (allocated for the round if freed)."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.padded, dtype=self.grad_dtype, device=self.param_flat.device)
        self.dirty = True
        o, n = self.offsets[i], self.params[i].numel()
        return self.full_grad[o:o + n]

    def accumulate(self, i: int, p: torch.Tensor) -> bool:
        """Add ``p.grad`` into the flat gradient and drop it (None: its gradient was already
        added by :meth:`add_product`); True when the round is complete."""
        if p.grad is not None:
            self._grad_view(i).add_(p.grad.reshape(-1))
            p.grad = None
        return self.count(i)

    def add_product(self, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """``grad(param i) += a^T b`` computed in fp32 into the fp32 flat gradient (``a``
        ``[T, out]``, ``b`` ``[T, in]``, param ``[out, in]``): one ``addmm_`` with the buffer as
        its output, so no gradient of the parameter's size exists in any other dtype."""
        view = self._grad_view(i).view(self.params[i].shape)
        view.addmm_(a.t().to(view.dtype), b.to(view.dtype))

    def add_rows(self, i: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``grad(param i)[ids] += rows`` in fp32 (an embedding table's gradient, ``index_add_``)."""
        view = self._grad_view(i).view(self.params[i].shape)
        view.index_add_(0, ids, rows.to(view.dtype))

    def count(self, i: int) -> bool:
        """Count one accumulation of parameter ``i``; True when the round is complete."""
        self.counts[i] += 1
        if self.counts[i] == self.flush_every:
            self.complete += 1
        return self.complete == len(self.params)

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element."""
        return self.grad_dtype.itemsize

    def flush(self, async_op: bool = True) -> Pending:
        """Reduce what has accumulated: stage 0 all-reduce (2L) else reduce-scatter (L) over DP."""
        self.counts = [0] * len(self.params)
        self.complete = 0
        self.dirty = False
        full = self.full_grad
        if self.stage == 0:
            return self.comm.all_reduce(full, self.group, logical=self.numel, async_op=async_op)
        direct = self.fresh
        out = self.grad_shard if direct else torch.empty_like(self.grad_shard)
        self.fresh = False
        if not self.persistent_grad:
            self.full_grad = None  # the next round allocates afresh; ``full`` lives until done

        def done():
            if not direct:
                self.grad_shard.add_(out)
            if self.persistent_grad:
                full.zero_()
        pending = self.comm.reduce_scatter(out, full, self.group, logical=self.numel, async_op=async_op)
        return Pending(pending, done)

    def sum_shared(self) -> None:
        """Sum the full gradient over the tie group (blocking; volume 2L on that group)."""
        if self.full_grad is not None:
            self.comm.all_reduce(self.full_grad, self.shared, logical=self.numel, async_op=False)

    def grad32(self) -> torch.Tensor:
        """This rank's gradient shard in fp32 (a view when the shard already is fp32)."""
        g = self.grad_shard
        if g is None:
            return torch.zeros_like(self.master)
        return g if g.dtype == torch.float32 else g.float()

    def zero_grad(self) -> None:
        """Empty the gradient shard after a step (the round counters are already reset)."""
        self.grad_shard.zero_()
        self.fresh = True

    def reset(self) -> None:
        """Drop every gradient accumulated since the last flush or step: the parameters'
        ``.grad``, the round counters, the full gradient and the shard."""
        for p in self.params:
            p.grad = None
        if self.dirty or not self.fresh:
            self.counts, self.complete, self.dirty = [0] * len(self.params), 0, False
            if self.full_grad is not None:
                self.full_grad.zero_()
            self.zero_grad()

    # ---- parameters ------------------------------------------------------------------------
    def write_back(self, async_op: bool = True) -> Pending:
        """Put the updated fp32 master shard back into the parameters (stage 1/2 all-gather, L)."""
        if self.partitioned:
            self.param_shard.copy_(self.master)
            return Pending()
        if self.stage == 0:
            self.param_flat.copy_(self.master)
            return Pending()
        own = self.param_flat[self.shard_lo:self.shard_lo + self.shard_len]
        own.copy_(self.master)  # cast into this rank's own piece: the gather's input, in place
        return self.comm.all_gather(self.param_flat, own, self.group, logical=self.numel, async_op=async_op)

    def gather(self, async_op: bool = True) -> Pending:
        """Stage 3: re-materialize the full parameters from the shards (all-gather, volume L)."""
        storage = self.param_flat.untyped_storage()
        storage.resize_(self.padded * self.param_flat.element_size())
        self.gathered = True
        return self.comm.all_gather(self.param_flat, self.param_shard, self.group, logical=self.numel, async_op=async_op,
                                    piece_elems=UNIT_GATHER_ELEMS)

    def release(self) -> None:
        """Stage 3: free the full parameters (the views stay, their storage shrinks to 0 bytes)."""
        self.param_flat.untyped_storage().resize_(0)
        self.gathered = False

    # ---- optimizer state -------------------------------------------------------------------
    def reload_master(self) -> None:
        """Re-read the fp32 master shard (and stage 3's parameter shard) from the parameters; a
        released stage-3 region re-reads its parameter shard (nothing is gathered)."""
        if self.partitioned and not self.gathered:
            self.master.copy_(self.param_shard)
            return
        shard = self.param_flat[self.shard_lo:self.shard_lo + self.shard_len]
        self.master.copy_(shard)
        if self.partitioned:
            self.param_shard.copy_(shard)

    def shard_state(self, copy: bool = True) -> dict:
        """This rank's ``master``, ``exp_avg``, ``exp_avg_sq`` shards (fp32): copies, or with
        ``copy=False`` the live tensors (to write them out before the next step)."""
        kinds = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        return {k: v.clone() if copy or not isinstance(v, torch.Tensor) else v for k, v in kinds.items()}

    def load_shard_state(self, state: dict) -> None:
        """Inverse of :meth:`shard_state` (same layout); call :meth:`write_back` after."""
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, kind).copy_(state[kind])

    def load_ranges(self, fetch, kinds=("master", "exp_avg", "exp_avg_sq")) -> None:
        """Fill this shard ``[lo, lo + len)`` parameter by parameter: for each parameter at
        ``[o, o + numel)`` overlapping it in ``[a, b)``, ``shard[a - lo : b - lo] = fetch(param,
        kind, a - o, b - o)`` (elements ``[a - o, b - o)`` of the parameter's flattened TP-local
        tensor), so only those elements are ever read.  Kind ``"weight"`` fills the master
        (rounded to the parameters' dtype first: masters = weights).  Call :meth:`write_back` after."""
        lo, hi = self.shard_lo, self.shard_lo + self.shard_len
        for p, o in zip(self.params, self.offsets):
            a, b = max(o, lo), min(o + p.numel(), hi)
            if a >= b:
                continue
            for kind in kinds:
                part = fetch(p, kind, a - o, b - o)
                if kind == "weight":
                    self.master[a - lo:b - lo].copy_(part.to(self.dtype))
                else:
                    getattr(self, kind)[a - lo:b - lo].copy_(part)

    def load_param_states(self, states_of) -> None:
        """Per parameter: ``states_of(param)`` -> ``{"master", "exp_avg", "exp_avg_sq"}`` of its
        (TP-local) shape; copies the part inside this shard (:meth:`load_ranges`)."""
        cache = {}

        def fetch(p, kind, a, b):
            if id(p) not in cache:
                cache.clear()
                cache[id(p)] = states_of(p)
            return cache[id(p)][kind].reshape(-1)[a:b]
        self.load_ranges(fetch)

    def describe(self, name_of: dict) -> dict:
        """``{"params": [[name, offset, numel], ...], "padded", "shard_lo", "shard_len",
        "partitioned"}`` (``name_of``: id(param) -> name; ``partitioned``: stage-3 unit whose
        parameters, too, exist only as this shard), for checkpoints."""
        return {"params": [[name_of[id(p)], o, p.numel()] for p, o in zip(self.params, self.offsets)],
                "padded": self.padded, "shard_lo": self.shard_lo, "shard_len": self.shard_len,
                "partitioned": self.partitioned}

    # ---- accounting ------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        psz, gsz = self.param_flat.element_size(), self.grad_bytes
        params = (self.shard_len if self.partitioned else self.padded) * psz
        grads = (self.padded if self.persistent_grad else self.shard_len) * gsz
        return {"params": params, "grads": grads, "master": 4 * self.shard_len,
                "moments": 4 * (self.exp_avg.numel() + self.exp_avg_sq.numel())}
