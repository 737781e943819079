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

or, where the caller packs the norm with its own per-iteration scalars into one all-reduce::

    partial = opt.grad_partials(over_world=True)      (device tensor, no collective)
    ... all-reduce [partial, loss, flags, ...] once, read it on the host once ...
    ok, grad_norm = opt.apply_step(total_sq, lr)

The only host sync in ``step`` is reading the one all-reduced scalar (sum of squared gradients,
inf/NaN if any rank overflowed) that decides skip-or-step identically on every rank.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megazero.parallel.host_reads import HostReads

from .adam_slices import adam_slice, shard_slices
from megazero.optim.adamw import adamw_step, sum_of_squares
from .collectives import Collectives, process_groups
from .loss_scaler import make_loss_scaler
from .region import Region
from .regions import RegionContext, build_expert_and_dense, cast_params, split_shard_ranges, trainable_params
from .param_sync import ParamSync
from .stage3 import ParamGatherer
from .accounting import StateAccounting
from .grad_sync import GradientSync
from .norms import count_zeros as zeros_in
from .state import ShardState


def grad_dtype(params_dtype: torch.dtype, accumulate_in_fp32: bool | None) -> torch.dtype:
    """fp32 gradients with fp32 parameters or ``accumulate_in_fp32`` (default: on with bf16,
    Megatron's ``--accumulate-allreduce-grads-in-fp32`` implied by ``--bf16``), else the params' dtype."""
    in_fp32 = params_dtype == torch.bfloat16 if accumulate_in_fp32 is None else accumulate_in_fp32
    return torch.float32 if in_fp32 or params_dtype == torch.float32 else params_dtype


class ZeroOptimizer(GradientSync, ShardState, StateAccounting):
    """See the module docstring and docs/zero.md.  ``model_chunks``: a module or list of them
    (virtual pipeline chunks); ``shared_params``: ``[(param, process_group)]`` whose gradients are
    summed over the group before DP reduction (same order on every member; the norm counts them
    on the group's first rank only); ``tp_duplicated_params``: parameters replicated across TP
    (norm counted on TP rank 0 only); ``units``: stage-3 unit modules per chunk (list of lists).
    The optimizer knows no model: both lists come from the model's ``ModelStages``.
    ``decoupled_weight_decay``: AdamW's decoupled decay (True) or L2 added to the gradient
    before the moments (False: ``torch.optim.Adam(weight_decay=...)``, DeepSpeed's Adam with
    ``adam_w_mode`` false); see :func:`~megazero.optim.adamw.adamw_step`.
    ``param_init``/``device``: for chunks built on the meta device (``ModelStages.param_init``),
    each parameter's initial value and where to put it; each region materializes its own
    parameters, so at stage 3 no rank holds more than one unit's full parameters while building
    (``build_peak_unit_bytes``). ``overlap_param_gather``: the stage 1/2 parameter all-gather
    of a step stays in flight until the next forward needs each bucket
    (:class:`~.param_sync.ParamSync`). ``host_reads``: the :class:`HostReads` counter every
    device-to-host read of :meth:`step` goes through (shared with the training loop).
    ``scaler_rule``: the fp16 dynamic scale's rule, ``"megatron"`` or ``"deepspeed"`` (the engine's)."""

    def __init__(self, model_chunks, topo, *, stage: int = 0, num_micro_batches: int = 1, lr: float = 1e-4,
                 weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8, clip_grad: float = 0.0,
                 decoupled_weight_decay: bool = True, params_dtype: torch.dtype | None = None,
                 accumulate_in_fp32: bool | None = None, loss_scale: float | None = None,
                 dynamic_loss_scale: bool | None = None, initial_loss_scale: float = 2.0 ** 32,
                 min_loss_scale: float = 1.0, loss_scale_window: int = 1000, hysteresis: int = 2,
                 reduce_bucket_size: int = 500_000_000, overlap_comm: bool = True,
                 prefetch_bucket_size: int = 50_000_000, param_persistence_threshold: int = 100_000,
                 max_live_parameters: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 shared_params=(), tp_duplicated_params=(), units=None, primitives: dict | None = None,
                 param_init=None, device=None, overlap_param_gather: bool = False, host_reads=None,
                 expert_params=(), scaler_rule: str = "megatron"):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.topo, self.stage, self.M = topo, stage, int(num_micro_batches)
        self.lr, self.weight_decay, self.betas, self.eps, self.clip_grad = lr, weight_decay, tuple(betas), eps, clip_grad
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.overlap, self.reduce_bucket_size = overlap_comm, int(reduce_bucket_size)
        trainable = trainable_params(chunks)
        self.device, self.params_dtype = cast_params(trainable, params_dtype)
        if self.device.type == "meta":  # built on the meta device: materialized by the regions below
            self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.grad_dtype = grad_dtype(self.params_dtype, accumulate_in_fp32)
        self.scaler = make_loss_scaler(self.params_dtype, loss_scale, dynamic_loss_scale, initial_loss_scale,
                                       min_loss_scale, loss_scale_window, hysteresis, scaler_rule, stage)

        groups, shared_of = process_groups(topo, shared_params)
        self.shared_names = list(dict.fromkeys(shared_of.values()))
        self.comm = Collectives(groups, dist.get_backend(), primitives)
        uncounted = {p for p in tp_duplicated_params if topo.tp_rank != 0}
        uncounted |= {p for p, name in shared_of.items() if groups[name][2] != 0}
        ctx = RegionContext(self.comm, stage, self.M, topo.dp_cp, topo.dp_cp_rank, self.grad_dtype, frozenset(uncounted),
                            param_init=param_init, device=self.device)
        built = build_expert_and_dense(ctx, chunks, trainable, shared_of, set(expert_params), topo, units=units,
                                       reduce_bucket_size=reduce_bucket_size,
                                       param_persistence_threshold=param_persistence_threshold)
        self.has_experts = bool(expert_params)  # their norm sums over the world at every stage
        self.regions: list[Region] = built.regions
        self.persistent_numel = built.persistent_numel
        self.build_peak_unit_bytes = built.peak_unit_bytes
        self.phi = sum(r.numel for r in self.regions)
        self.gatherer = None
        if built.units:
            self.gatherer = ParamGatherer(built.units, prefetch_bucket_size=prefetch_bucket_size,
                                          max_live_parameters=max_live_parameters,
                                          max_reuse_distance=max_reuse_distance, overlap=overlap_comm)
        self._hooks = self._register_hooks(chunks)
        self.host = host_reads if host_reads is not None else HostReads()
        self._scale_tensor = None  # the loss scale on the device (see loss_scale)
        self._grads = None  # unscaled fp32 gradients between grad_partials and apply_step
        gathered = any(r.stage >= 1 and not r.partitioned for r in self.regions)  # regions with an all-gather
        self.param_sync = ParamSync(chunks, self.regions) if overlap_param_gather and gathered else None
        self._synced = False
        self.iteration = self.skipped_iterations = self.nan_iterations = 0  # steps taken, skipped, NaN
        self.last_comm: dict = {}
        self._lr_ranges = None  # set_decoupled_params: per region, (other, decoupled) shard ranges
        self._group_ranges = None  # set_param_groups: per group, per region, its shard ranges
        self.muon = None  # set_muon: the Muon matrices' step (zero/muon_shards.py)

    # ---- gradients -------------------------------------------------------------------------
    @property
    def loss_scale(self) -> torch.Tensor:
        """The factor the schedule multiplies the loss gradient by (fp16 dynamic; else constant)."""
        if self._scale_tensor is None:
            self._scale_tensor = torch.empty((), dtype=torch.float32, device=self.device)
        return self._scale_tensor.fill_(self.scaler.scale)  # a device fill, not a host-to-device copy

    # ---- the step --------------------------------------------------------------------------
    def set_decoupled_params(self, params) -> None:
        """Parameters that take ``step``'s ``decoupled_lr`` (Megatron's ``--decoupled-lr``: the
        embedding and output layer); their pieces of this rank's shards are set apart here, once."""
        ids = {id(p) for p in params}
        self._lr_ranges = [split_shard_ranges(r, ids) for r in self.regions]

    def set_param_groups(self, groups) -> None:
        """User parameter groups (``torch.optim`` style, each a list of parameters, every
        trainable parameter in exactly one): :meth:`apply_step` then takes one ``hparams`` dict
        per group (``lr``, ``betas``, ``eps``, ``weight_decay``, applied to all of the group's
        elements, as ``torch.optim.AdamW`` does) instead of the matrices-only decay."""
        sets = [{id(p) for p in ps} for ps in groups]
        self._group_ranges = [[split_shard_ranges(r, ids)[1] for r in self.regions] for ids in sets]

    def set_muon(self, settings, matrices) -> None:
        """Step ``matrices`` (``{param: MuonMatrix}``) with Muon (``settings``: a
        :class:`~megazero.optim.muon.MuonSettings`), the rest with AdamW; see :mod:`.muon_shards`."""
        from .muon_shards import MuonShards
        self.muon = MuonShards(self.regions, self.comm, settings, matrices)

    @property
    def norm_group(self) -> str:
        """The group over which the partial sums of :meth:`grad_partials` add up to the global
        norm: ``mp`` at stage 0 (every DP replica holds the same all-reduced gradients), else
        ``world`` (also at stage 0 for an MoE model: its experts differ across EP ranks)."""
        return "mp" if self.stage == 0 and not self.has_experts else "world"

    def grad_partials(self, over_world: bool = False, count_zeros: bool = False) -> torch.Tensor:
        """Unscale the gradients (``g /= scale * DP * CP``: mean over DP x CP of the seeded loss gradient)
        and return this rank's partial ``[sum(g^2)]`` (``[sum(g^2), zeros]`` with
        ``count_zeros``: Megatron's ``--log-num-zeros-in-grad``) as a device tensor: no
        collective, no host read. Each parameter is counted on one rank of its TP/shared group;
        ``over_world`` (the caller sums over the whole world, not :attr:`norm_group`): at stage 0
        only DP rank 0 counts, so the world sum equals the model-parallel one."""
        self.finish_grad_sync()
        grads = [r.grad32() for r in self.regions]
        torch._foreach_mul_(grads, 1.0 / (self.scaler.scale * self.topo.dp_cp))
        self._grads = grads
        world = over_world or self.norm_group == "world"
        pieces = [g[a:b] for r, g in zip(self.regions, grads) if r.counts_in_world or not world
                  for a, b in r.norm_segments]
        parts = [sum_of_squares(pieces, self.device).reshape(1)]
        if count_zeros:
            parts.append(zeros_in(pieces, self.device).reshape(1).float())
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def step(self, lr: float | None = None, decoupled_lr: float | None = None, hparams=None):
        """Unscale (and average over DP), check inf/NaN world-wide, clip, AdamW, write back:
        :meth:`grad_partials`, one all-reduce over :attr:`norm_group`, one host read, then
        :meth:`apply_step` (the training loop packs the partials with its own scalars instead).
        Returns ``(True, grad_norm)``, or ``(False, inf or nan)`` when the step was skipped."""
        sq = self.grad_partials()
        self.comm.all_reduce(sq, self.norm_group, async_op=False)
        return self.apply_step(self.host.read(sq)[0], lr, decoupled_lr, hparams=hparams)

    def apply_step(self, total_sq: float, lr: float | None = None, decoupled_lr: float | None = None, hparams=None):
        """The step after :meth:`grad_partials`, given ``total_sq`` = the all-reduced sum of
        squared gradients (identical on every rank, so every rank skips or steps alike): skip
        on inf/NaN (fp16 overflow), else clip by ``min(1, clip / (norm + 1e-6))``, AdamW and
        the write-back of the parameters (with overlap: left in flight until the next forward).

        ``decoupled_lr``: the rate of the parameters given to :meth:`set_decoupled_params` (their
        weight decay ``p *= 1 - lr * wd`` too, as a torch param group's); None: ``lr`` for all.
        ``hparams``: after :meth:`set_param_groups`, one settings dict per group."""
        grads, self._grads = self._grads, None
        lr = self.lr if lr is None else lr
        if not math.isfinite(total_sq):
            self.skipped_iterations += 1
            self.nan_iterations += int(math.isnan(total_sq))
            self._end_step(found_inf=True)
            return False, total_sq
        norm = math.sqrt(total_sq)
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self.iteration += 1
        if hparams is not None:
            self._group_step(grads, hparams)
            groups = []
        else:
            groups = [(lr, [[(0, r.shard_len)] for r in self.regions])]
        if decoupled_lr is not None and self._lr_ranges is not None and groups:
            groups = [(lr, [main for main, _ in self._lr_ranges]), (decoupled_lr, [d for _, d in self._lr_ranges])]
        if self.muon is not None and groups:
            groups = [(group_lr, self.muon.adam_ranges(ranges)) for group_lr, ranges in groups]
            self.muon.step(self.regions, grads, lr=lr, weight_decay=self.weight_decay)
        for group_lr, ranges in groups:
            for lists, decay_grads in shard_slices(self.regions, grads, adam_slice(self.device), ranges):
                adamw_step(*lists, step=self.iteration, lr=group_lr, betas=self.betas, eps=self.eps,
                           decay_grads=decay_grads, weight_decay=self.weight_decay,
                           decoupled=self.decoupled_weight_decay)
        if self.param_sync is not None:
            self.param_sync.launch(self.regions)
        else:
            for pending in [r.write_back(async_op=True) for r in self.regions]:
                pending.wait()
        self._end_step(found_inf=False)
        return True, norm

    def discard_step(self) -> None:
        """Drop the gradients of a step that will not be applied (its iteration is run again,
        megazero.training.rerun): zeroed as after a step, the loss scale and counters untouched."""
        self._grads = None
        for r in self.regions:
            r.zero_grad()

    def _group_step(self, grads, hparams) -> None:
        """Adam(W) group by group over each group's shard ranges (:meth:`set_param_groups`)."""
        if self._group_ranges is None or len(hparams) != len(self._group_ranges):
            raise ValueError("apply_step(hparams=...) needs one dict per group given to set_param_groups")
        muon = [h for h in hparams if h.get("use_muon")]
        if self.muon is not None and muon:
            if any((h["lr"], h["weight_decay"]) != (muon[0]["lr"], muon[0]["weight_decay"]) for h in muon):
                raise ValueError("Muon param groups must share one lr and weight_decay")
            self.muon.step(self.regions, grads, lr=muon[0]["lr"], weight_decay=muon[0]["weight_decay"])
        for h, ranges in zip(hparams, self._group_ranges):
            if h.get("use_muon"):
                continue
            if self.muon is not None:
                ranges = self.muon.adam_ranges(ranges)
            for lists, decay_grads in shard_slices(self.regions, grads, adam_slice(self.device), ranges,
                                                     decay_all=True):
                adamw_step(*lists, step=self.iteration, lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                           decay_grads=decay_grads, weight_decay=h["weight_decay"],
                           decoupled=self.decoupled_weight_decay)

    def wait_params(self) -> None:
        """Finish the parameter all-gathers still in flight (``--overlap-param-gather``) before
        parameters are read or written outside a forward: saving, loading, inspection."""
        if self.param_sync is not None:
            self.param_sync.wait_all()

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
    @contextlib.contextmanager
    def gathered_params(self):
        """Stage 3: materialize every parameter (e.g. to read or save them); no-op otherwise."""
        self.wait_params()
        if self.gatherer is None:
            yield
            return
        self.gatherer.gather_all()
        try:
            yield
        finally:
            self.gatherer.end_of_step()

    def reload_model_params(self) -> None:
        """Re-read the fp32 master shards from the parameters (done automatically after a
        chunk's ``load_state_dict``; stage 3 reads released units from their parameter shards)."""
        self.wait_params()
        for r in self.regions:
            r.reload_master()

    def close(self) -> None:
        """Remove every hook this optimizer registered."""
        for h in self._hooks:
            h.remove()
        if self.param_sync is not None:
            self.param_sync.remove()
        if self.gatherer is not None:
            self.gatherer.remove()
