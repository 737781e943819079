"""ZeroOptimizer: data parallelism with ZeRO stages 0-3, mixed precision, loss scaling, clipping.

Per step, with Φ = trainable parameters on this rank (its TP/PP shard), N = DP size and M
micro-batches, the logical (ring-equivalent) DP volume per rank is:

* stage 0: all-reduce of every bucket once, after its M-th accumulation -> 2Φ
* stage 1: reduce-scatter once after the M-th accumulation + all-gather of updated params -> 2Φ
* stage 2: reduce-scatter every micro-batch (only the shard is kept) + all-gather -> (M + 1)Φ
* stage 3: per micro-batch all-gather (forward) + all-gather (backward) + reduce-scatter -> 3MΦ
  (less with a reuse distance or persistent small parameters, which behave as stage 1)

Calling sequence per iteration (any pipeline schedule; no ``no_sync`` protocol)::

    loss-grad seed = opt.loss_scale / M    (the schedule)
    ... forward/backward of every micro-batch, hooks reduce buckets as they become ready ...
    opt.finish_grad_sync()                 (waits; reduces what never became ready; tied weights)
    ok, grad_norm = opt.step(lr)           (unscale, inf check, norm, clip, AdamW, write back)

The only host sync in ``step`` is reading the one all-reduced scalar (sum of squared gradients,
inf/NaN if any rank overflowed) that decides skip-or-step identically on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.tensor_parallel.spec import tp_duplicated_params

from .adamw import adamw_step, sum_of_squares
from .collectives import Collectives
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .region import Region
from .stage3 import ParamGatherer, find_units


class ZeroOptimizer:
    """See the module docstring and docs/zero.md.  ``model_chunks``: a module or list of them
    (virtual pipeline chunks); ``shared_params``: ``[(param, process_group)]`` whose gradients are
    summed over the group before DP reduction (same order on every member; the norm counts them
    on the group's first rank only); ``tp_duplicated_params``: parameters replicated across TP
    (norm counted on TP rank 0 only); ``units``: stage-3 unit modules per chunk (list of lists)."""

    def __init__(self, model_chunks, topo, *, stage: int = 0, num_micro_batches: int = 1, lr: float = 1e-4,
                 weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8, clip_grad: float = 0.0,
                 params_dtype: torch.dtype | None = None, accumulate_in_fp32: bool | None = None,
                 loss_scale: float | None = None, dynamic_loss_scale: bool | None = None,
                 initial_loss_scale: float = 2.0 ** 32, min_loss_scale: float = 1.0, loss_scale_window: int = 1000,
                 hysteresis: int = 2, reduce_bucket_size: int = 500_000_000, allgather_bucket_size: int = 500_000_000,
                 overlap_comm: bool = True, contiguous_gradients: bool = True, prefetch_bucket_size: int = 50_000_000,
                 param_persistence_threshold: int = 100_000, max_live_parameters: int = 1_000_000_000,
                 max_reuse_distance: int = 1_000_000_000, shared_params=(), tp_duplicated_params=(), units=None,
                 primitives: dict | None = None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.topo, self.stage, self.M = topo, stage, int(num_micro_batches)
        self.lr, self.weight_decay, self.betas, self.eps, self.clip_grad = lr, weight_decay, tuple(betas), eps, clip_grad
        self.overlap = overlap_comm
        self.allgather_bucket_size, self.contiguous_gradients = allgather_bucket_size, contiguous_gradients

        trainable, seen = [], set()
        for chunk in chunks:
            ps = [p for p in chunk.parameters() if p.requires_grad and p not in seen]
            seen.update(ps)
            trainable.append(ps)
        first = next((p for ps in trainable for p in ps), None)
        if first is None:
            raise ValueError("no trainable parameters")
        self.device = first.device
        dtype = params_dtype or first.dtype
        for ps in trainable:
            for p in ps:
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
        self.params_dtype = dtype
        if accumulate_in_fp32 is None:
            accumulate_in_fp32 = dtype == torch.bfloat16
        self.grad_dtype = torch.float32 if (accumulate_in_fp32 or dtype == torch.float32) else dtype

        if loss_scale is not None:
            self.scaler = ConstantLossScaler(loss_scale)
        elif dynamic_loss_scale or (dynamic_loss_scale is None and dtype == torch.float16):
            self.scaler = DynamicLossScaler(initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
        else:
            self.scaler = ConstantLossScaler(1.0)

        # ---- groups ----
        backend = dist.get_backend()
        groups = {"dp": (topo.dp_group, topo.dp, topo.dp_rank),
                  "mp": (topo.model_parallel_group, topo.tp * topo.pp, dist.get_rank(topo.model_parallel_group)),
                  "world": (None, dist.get_world_size(), dist.get_rank())}
        shared_of, self.shared_names = {}, []
        for p, g in shared_params:
            name = next((n for n, (gg, _, _) in groups.items() if gg is g and n.startswith("tie")), None)
            if name is None:
                name = f"tie{len(self.shared_names)}"
                groups[name] = (g, dist.get_world_size(g), dist.get_rank(g))
                self.shared_names.append(name)
            shared_of[p] = name
        self.comm = Collectives(groups, backend, primitives)
        tp_dup = set(tp_duplicated_params)

        def counted(p):
            if p in tp_dup and topo.tp_rank != 0:
                return False
            return not (p in shared_of and groups[shared_of[p]][2] != 0)

        def region(ps, chunk, *, partitioned=False, flush_every=None, keep_full=None, shared=None):
            flush = flush_every if flush_every is not None else (1 if stage == 2 else self.M)
            keep = keep_full if keep_full is not None else stage <= 1
            return Region(ps, [counted(p) for p in ps], comm=self.comm, dp_size=topo.dp, dp_rank=topo.dp_rank,
                          stage=stage, partitioned=partitioned, flush_every=flush, keep_full_grad=keep,
                          grad_dtype=self.grad_dtype, shared=shared, chunk=chunk)

        # ---- regions: buckets (stage 0-2) or units (stage 3), then tie groups ----
        self.regions: list[Region] = []
        stage3_units = []
        self.persistent_numel = 0
        for c, (chunk, ps) in enumerate(zip(chunks, trainable)):
            own = [p for p in ps if p not in shared_of]
            if stage < 3:
                self.regions += [region(b, c) for b in _buckets(list(reversed(own)), reduce_bucket_size)]
                continue
            regs = defaultdict(int)
            for m in chunk.modules():
                for p in m.parameters(recurse=False):
                    regs[p] += 1
            ownset = set(own)
            persistent = [p for p in own if regs[p] > 1 or p.numel() < param_persistence_threshold]
            pset = set(persistent)
            chunk_units = units[c] if units is not None else None
            for module, ups in reversed(find_units(chunk, chunk_units)):
                ups = [p for p in ups if p in ownset and p not in pset]
                if ups:
                    r = region(ups, c, partitioned=True, flush_every=1, keep_full=False)
                    self.regions.append(r)
                    stage3_units.append((module, r, c, module is chunk))
            if persistent:
                self.persistent_numel += sum(p.numel() for p in persistent)
                self.regions.append(region(list(reversed(persistent)), c, flush_every=self.M, keep_full=True))
        for name in self.shared_names:
            ps = [p for p, g in shared_params if shared_of[p] == name]
            self.regions.append(region(ps, -1, flush_every=self.M, keep_full=True, shared=name))
        self.gatherer = None
        if stage3_units:
            self.gatherer = ParamGatherer(stage3_units, prefetch_bucket_size=prefetch_bucket_size,
                                          max_live_parameters=max_live_parameters,
                                          max_reuse_distance=max_reuse_distance, overlap=overlap_comm)

        self.phi = sum(r.numel for r in self.regions)
        self._hooks = []
        if self.gatherer is not None:  # loading model weights re-reads the fp32 master shards
            self.gatherer.hook_state_dicts(chunks, self.reload_model_params)
        else:
            self._hooks += [c.register_load_state_dict_post_hook(lambda m, k: self.reload_model_params())
                            for c in chunks]
        for r in self.regions:
            for i, p in enumerate(r.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(r, i)))
        self._inflight = []
        self._max_inflight = 4 if stage >= 2 else 1 << 30
        self._synced = False
        self.iteration = 0  # optimizer steps taken (not skipped)
        self.skipped_iterations = 0
        self.nan_iterations = 0
        self.last_comm: dict = {}

    @classmethod
    def from_args(cls, args, model_chunks, topo, **kw):
        """Build from megazero.arguments (Megatron / DeepSpeed flag names).

        Unless given in ``kw``: ``shared_params`` are the chunks' ``shared_embedding_weight()``
        (PP > 1, first/last stage) over ``topo.embedding_group``; ``tp_duplicated_params`` come
        from :func:`tp_duplicated_params` (no import of the model package: duck typing).
        """
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if "shared_params" not in kw and topo.pp > 1:
            ws = [c.shared_embedding_weight() for c in chunks if hasattr(c, "shared_embedding_weight")]
            kw["shared_params"] = [(w, topo.embedding_group) for w in ws if w is not None]
        if "tp_duplicated_params" not in kw:
            kw["tp_duplicated_params"] = tp_duplicated_params(chunks, topo.tp)
        const = args.loss_scale if args.fp16 and args.loss_scale else None
        opts = dict(stage=args.zero_stage, num_micro_batches=args.num_micro_batches, lr=args.lr,
                    weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                    clip_grad=args.clip_grad, params_dtype=args.params_dtype,
                    accumulate_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32), loss_scale=const,
                    dynamic_loss_scale=bool(args.fp16 and not args.loss_scale),
                    initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                    loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                    reduce_bucket_size=args.zero_reduce_bucket_size,
                    allgather_bucket_size=args.zero_allgather_bucket_size, overlap_comm=args.zero_overlap_comm,
                    contiguous_gradients=args.zero_contiguous_gradients,
                    prefetch_bucket_size=args.zero_prefetch_bucket_size,
                    param_persistence_threshold=args.zero_param_persistence_threshold,
                    max_live_parameters=args.zero_max_live_parameters,
                    max_reuse_distance=args.zero_max_reuse_distance)
        opts.update(kw)
        return cls(chunks, topo, **opts)

    # ---- gradients -------------------------------------------------------------------------
    @property
    def loss_scale(self) -> torch.Tensor:
        """The factor the schedule multiplies the loss gradient by (fp16 dynamic; else constant)."""
        return torch.tensor(self.scaler.scale, dtype=torch.float32, device=self.device)

    def _grad_hook(self, r: Region, i: int):
        def hook(p):
            self._synced = False
            if r.accumulate(i, p) and r.shared is None:
                if r.flush_every == 1 or self.overlap:
                    self._launch(r, async_op=self.overlap)
                if self.gatherer is not None and r.partitioned:
                    self.gatherer.backward_done(r)
        return hook

    def _launch(self, r: Region, async_op: bool) -> None:
        pending = r.flush(async_op=async_op)
        if not async_op:
            pending.wait()
            return
        self._inflight.append(pending)
        while len(self._inflight) > self._max_inflight:
            self._inflight.pop(0).wait()

    def finish_grad_sync(self) -> None:
        """After the schedule: reduce what did not become ready, sum tied weights, wait for all."""
        if self._synced:
            return
        for r in self.regions:
            if r.shared is None and r.dirty:
                self._launch(r, async_op=True)
        for r in self.regions:
            if r.shared is not None:
                r.sum_shared()
                self._launch(r, async_op=True)
        while self._inflight:
            self._inflight.pop(0).wait()
        if self.gatherer is not None:
            self.gatherer.end_of_step()
        self._synced = True

    # ---- the step --------------------------------------------------------------------------
    def step(self, lr: float | None = None):
        """Unscale (and average over DP), check inf/NaN world-wide, clip, AdamW, write back.

        Returns ``(True, grad_norm)``, or ``(False, inf or nan)`` when the step was skipped.
        """
        self.finish_grad_sync()
        lr = self.lr if lr is None else lr
        grads = [r.grad32() for r in self.regions]
        torch._foreach_mul_(grads, 1.0 / (self.scaler.scale * self.topo.dp))
        sq = sum_of_squares([g[a:b] for r, g in zip(self.regions, grads) for a, b in r.norm_segments], self.device)
        sq = sq.reshape(1)
        self.comm.all_reduce(sq, "mp" if self.stage == 0 else "world", async_op=False)
        total = sq.item()  # the one host sync: every rank reads the same all-reduced value
        if not math.isfinite(total):
            self.skipped_iterations += 1
            self.nan_iterations += int(math.isnan(total))
            self._end_step(found_inf=True)
            return False, total
        norm = math.sqrt(total)
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self.iteration += 1
        decay = [r.master[a:b] for r in self.regions for a, b in r.decay_segments]
        adamw_step([r.master for r in self.regions], grads, [r.exp_avg for r in self.regions],
                   [r.exp_avg_sq for r in self.regions], decay, step=self.iteration, lr=lr, betas=self.betas,
                   eps=self.eps, weight_decay=self.weight_decay)
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()
        self._end_step(found_inf=False)
        return True, norm

    def _end_step(self, found_inf: bool) -> None:
        for r in self.regions:
            r.zero_grad()
        self.scaler.update(found_inf)
        comm = self.comm.reset()
        dp = [v for k, v in comm.items() if k.startswith("dp/")]
        self.last_comm = {"phi": self.phi, "by_group": comm,
                          "dp_logical_multiple": sum(v["logical_elems"] for v in dp) / self.phi,
                          "dp_primitive_multiple": sum(v["primitive_elems"] for v in dp) / self.phi}

    # ---- accounting, inspection, state -----------------------------------------------------
    def state_bytes(self) -> dict:
        """Model-state bytes on this rank and the ZeRO paper's formula for this stage."""
        tot = defaultdict(int)
        for r in self.regions:
            for k, v in r.state_bytes().items():
                tot[k] += v
        tot = dict(tot, total=sum(tot.values()))
        p = torch.empty((), dtype=self.params_dtype).element_size()
        g = torch.empty((), dtype=self.grad_dtype).element_size()
        phi, n = self.phi, self.topo.dp
        formula = [(p + g + 12) * phi, (p + g) * phi + 12 * phi / n, p * phi + (g + 12) * phi / n,
                   (p + g + 12) * phi / n][self.stage]
        return dict(tot, formula=formula, phi=phi, dp=n, param_bytes=p, grad_bytes=g)

    @contextlib.contextmanager
    def gathered_params(self):
        """Stage 3: materialize every parameter (e.g. to read or save them); no-op otherwise."""
        if self.gatherer is None:
            yield
            return
        self.gatherer.gather_all()
        try:
            yield
        finally:
            self.gatherer.end_of_step()

    def zero_grad(self) -> None:
        """Drop any gradient accumulated since the last step (``step`` already leaves none)."""
        while self._inflight:
            self._inflight.pop(0).wait()
        for r in self.regions:
            for p in r.params:
                p.grad = None
            if r.dirty or not r.fresh:
                r.counts, r.complete, r.dirty = [0] * len(r.params), 0, False
                if r.full_grad is not None:
                    r.full_grad.zero_()
                r.zero_grad()

    def reload_model_params(self) -> None:
        """Re-read the fp32 master shards from the parameters (done automatically after a
        chunk's ``load_state_dict``; stage 3 otherwise needs ``with opt.gathered_params():``)."""
        for r in self.regions:
            shard = r.param_flat[r.shard_lo:r.shard_lo + r.shard_len]
            r.master.copy_(shard)
            if r.partitioned:
                r.param_shard.copy_(shard)

    def comm_scalars(self) -> dict:
        """TensorBoard scalars of the last step's accounting."""
        c = self.last_comm
        if not c:
            return {}
        return {"zero/comm-multiple": c["dp_logical_multiple"], "zero/primitive-multiple": c["dp_primitive_multiple"],
                "zero/state-bytes": float(self.state_bytes()["total"])}

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "scaler": self.scaler.state_dict(),
                "skipped_iterations": self.skipped_iterations, "nan_iterations": self.nan_iterations,
                "shards": [{"master": r.master.clone(), "exp_avg": r.exp_avg.clone(),
                            "exp_avg_sq": r.exp_avg_sq.clone()} for r in self.regions]}

    def load_counters(self, sd: dict) -> None:
        """Step count, loss scaler and skip counters of a :meth:`state_dict` (layout-free)."""
        self.iteration = sd["iteration"]
        self.scaler.load_state_dict(sd["scaler"])
        self.skipped_iterations, self.nan_iterations = sd["skipped_iterations"], sd["nan_iterations"]

    def load_state_dict(self, sd: dict) -> None:
        self.load_counters(sd)
        for r, s in zip(self.regions, sd["shards"]):
            r.master.copy_(s["master"])
            r.exp_avg.copy_(s["exp_avg"])
            r.exp_avg_sq.copy_(s["exp_avg_sq"])
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()

    def layout(self, name_of: dict) -> list[dict]:
        """Self-description of the flat regions, for checkpoints: per region the ordered
        ``[name, offset, numel]`` of its parameters (``name_of``: id(param) -> name), its
        ``padded`` length and this rank's shard ``[shard_lo, shard_lo + shard_len)``."""
        return [{"params": [[name_of[id(p)], o, p.numel()] for p, o in zip(r.params, r.offsets)],
                 "padded": r.padded, "shard_lo": r.shard_lo, "shard_len": r.shard_len} for r in self.regions]

    @torch.no_grad()
    def load_param_states(self, states_of) -> None:
        """Set master weights and both Adam moments per parameter, then write the parameters back.

        ``states_of(param)`` returns ``{"master", "exp_avg", "exp_avg_sq"}``: fp32 tensors of the
        parameter's (TP-local) shape; only the part inside this rank's shard is copied:
        ``shard[a - lo : b - lo] = state.flat[a - o : b - o]`` with ``[a, b)`` the overlap of
        ``[o, o + numel)`` and ``[lo, lo + len)``.  Collective (the write-back all-gathers)."""
        for r in self.regions:
            lo, hi = r.shard_lo, r.shard_lo + r.shard_len
            for p, o in zip(r.params, r.offsets):
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a >= b:
                    continue
                states = states_of(p)
                for kind, buf in (("master", r.master), ("exp_avg", r.exp_avg), ("exp_avg_sq", r.exp_avg_sq)):
                    buf[a - lo:b - lo].copy_(states[kind].reshape(-1)[a - o:b - o])
        for pending in [r.write_back(async_op=True) for r in self.regions]:
            pending.wait()

    def close(self) -> None:
        """Remove every hook this optimizer registered."""
        for h in self._hooks:
            h.remove()
        if self.gatherer is not None:
            self.gatherer.remove()


def _buckets(params, size: int):
    """Split params (already in execution order) into runs of about ``size`` elements each."""
    out, cur, n = [], [], 0
    for p in params:
        cur.append(p)
        n += p.numel()
        if n >= size:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out
