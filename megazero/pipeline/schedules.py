"""Run one step's pipeline plan: forwards, backwards and batched p2p exchanges of one rank.

:class:`PipelineRunner` is built once per run: it picks the schedule from the layout -- no
pipelining (PP = 1, gradient accumulation), 1F1B (VP = 1, warm-up ``PP - r - 1``, bubble
fraction ``(PP - 1) / M``) or interleaved 1F1B (VP > 1, warm-up ``2 (PP - r - 1) + (VP - 1) PP``,
bubble fraction ``(PP - 1) / (VP M)``) -- builds this rank's action lists (:mod:`.plan`, one
for training, one forward-only) and the :class:`~.p2p.P2PCommunicator`; :meth:`PipelineRunner.run`
executes one step.  It knows no model: the chunks, the micro-batches and the forward step are
arguments.  :func:`forward_backward` is the one-call form (builds a runner for that one step).
``topo.pipeline_schedule`` names a zero-bubble plan instead (``zb-h1``, ``interleaved-zb``,
``zbv``, ``dualpipev``: :mod:`.zero_bubble`).

Split backward: a plan's ``W m.c`` computes the weight gradients whose ``B m.c`` computed only
input gradients.  The chunks' weight-gradient stores (``run(..., weight_grad_stores=)``,
:mod:`megazero.tensor_parallel.weight_grad_store`, duck-typed here) defer while ``F`` and ``B`` of
such an ``(m, c)`` run and deliver at ``W``; without stores, or for a plan without ``W``, every
``B`` computes all gradients.  The V's turn (an op whose peer is this rank) hands the tensor
from one chunk to the other without a process exchange.

Losses: on the last virtual stage ``forward_step_func`` returns the micro-batch's scalar loss;
the backward is seeded with ``loss * grad_scale / M`` (so gradients are those of the mean loss
over micro-batches, times the fp16 loss scale), and the unscaled per-micro-batch losses are
returned (detached, no host sync).  Other ranks return ``[]``.

Memory: once an output activation has been sent, its storage is released (``.data`` replaced
by a 1-element tensor) and only its autograd edge is kept; the backward later runs from that
edge (``torch.autograd.backward(GradientEdge, grad)``, public API, which takes the shape from
the graph node rather than from the freed tensor).  A rank so holds, per in-flight micro-batch
and chunk, only the received input and what autograd saved: at most ``PP - r`` micro-batches
with 1F1B, ``warm-up + 1`` chunk-activations interleaved.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from .p2p import P2PCommunicator
from .plan import build_plan, schedule_name, split_backwards, warmup_count
from .streams import next_comms


class _Step:
    """The state of one step being executed (inputs, autograd edges, pending sends, losses)."""

    def __init__(self, chunks, microbatches, topo, forward_step_func, comm, grad_scale, forward_only, trace,
                 stores=None):
        self.chunks, self.mbs, self.topo = chunks, microbatches, topo
        self.stores = stores if stores is not None else [None] * len(chunks)  # per chunk: WeightGradStore
        self.deferred = set()  # (m, c) whose weight gradients wait for the plan's W
        self.step_fn, self.comm = forward_step_func, comm
        self.grad_scale, self.forward_only, self.trace = grad_scale, forward_only, trace
        self.vp, self.m = len(chunks), len(microbatches)
        self.inputs = {}     # (m, c) -> received input activation (a leaf that collects its grad)
        self.edges = {}      # (m, c) -> autograd edge of the sent output
        self.seeds = {}      # (m, c) -> scaled loss to backward from (last virtual stage)
        self.out_grads = {}  # (m, c) -> received gradient of the output
        self.to_send = {}    # ("act"|"grad", m, c) -> tensor
        self.handed = {}     # ("act"|"grad", m) -> tensor handed to this rank's other chunk (the V's turn)
        self.losses = []
        self.live = self.max_live = 0
        self.landed = 0      # weights whose gradient a W delivered

    def deferring(self, mb, c):
        """The F and B of a micro-batch with a W in the plan run with the chunk's store deferring."""
        store = self.stores[c]
        return store.deferring(mb) if store is not None and (mb, c) in self.deferred else nullcontext()

    def is_first(self, c):
        return c == 0 and self.topo.is_first_stage

    def is_last(self, c):
        return c == self.vp - 1 and self.topo.is_last_stage

    def forward(self, mb, c):
        x = self.inputs.get((mb, c))
        if x is None and not self.is_first(c):
            raise RuntimeError(f"pipeline rank {self.topo.pp_rank}: no input received for micro-batch {mb} chunk {c}")
        with self.deferring(mb, c):
            out = self.step_fn(self.chunks[c], self.mbs[mb], x)
        if self.forward_only:
            self.inputs.pop((mb, c), None)
        if self.is_last(c):
            if not isinstance(out, torch.Tensor) or out.dim() != 0:
                raise RuntimeError("forward_step_func must return a scalar loss on the last pipeline stage")
            self.losses.append(out.detach())
            if not self.forward_only:
                self.seeds[(mb, c)] = out * self.grad_scale / self.m
        else:
            self.to_send[("act", mb, c)] = out
            if not self.forward_only and out.requires_grad:
                self.edges[(mb, c)] = get_gradient_edge(out)
        if not self.forward_only:
            self.live += 1
            self.max_live = max(self.max_live, self.live)

    def backward(self, mb, c):
        with self.deferring(mb, c):
            if self.is_last(c):
                self.seeds.pop((mb, c)).backward()
            else:
                grad = self.out_grads.pop((mb, c))
                edge = self.edges.pop((mb, c), None)
                if edge is not None:
                    torch.autograd.backward(edge, grad_tensors=grad)
        x = self.inputs.pop((mb, c), None)
        if not self.is_first(c):
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            self.to_send[("grad", mb, c)] = g
        self.live -= 1

    def weight(self, mb, c):
        """Action W: the weight gradients the B of (mb, c) left in the chunk's store (none when
        the chunk has no store: then B computed them)."""
        if (mb, c) in self.deferred:
            self.landed += self.stores[c].run(mb)

    def exchange(self, ops, ahead=()):
        """COMM: hand-overs inside the rank, then the sends and receives with other ranks; ``ahead``:
        the next COMM's receive ops, posted now (:meth:`~.p2p.P2PCommunicator.exchange`)."""
        me = self.topo.pp_rank
        sends = [op for op in ops if op.op == "send"]
        for op in sends:
            if op.peer == me:  # the V's turn: a hand-over between this rank's chunks, no process
                self.handed[(op.what, op.mb)] = self.to_send.pop((op.what, op.mb, op.chunk))
        sends = [op for op in sends if op.peer != me]
        recv_ops = [op for op in ops if op.op == "recv" and op.peer != me]
        tensors = [self.to_send.pop((op.what, op.mb, op.chunk)) for op in sends]
        received = self.comm.exchange(list(zip(tensors, [op.peer for op in sends])),
                                      [(op.key, op.peer) for op in recv_ops],
                                      [(op.key, op.peer) for op in ahead if op.op == "recv" and op.peer != me])
        for tensor, op in zip(tensors, sends):
            if op.what == "act" and tensor._base is None:  # free the sent activation's storage
                tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)  # (a view's base
                # would keep it alive anyway); its autograd edge stays for the backward
        handed = [(self.handed.pop((op.what, op.mb)).detach(), op) for op in ops if op.op == "recv" and op.peer == me]
        for t, op in list(zip(received, recv_ops)) + handed:
            if op.what == "act":
                self.inputs[(op.mb, op.chunk)] = t.requires_grad_(not self.forward_only)
            else:
                self.out_grads[(op.mb, op.chunk)] = t

    def run(self, plan):
        trace, clock = self.trace, time.perf_counter
        if trace is not None:
            if self.topo.pp > 1:
                dist.barrier(group=self.topo.pp_group)
            trace.begin(self.topo, schedule_name(self.topo.pp, self.vp, _schedule(self.topo)), self.m, self.vp)
        if not self.forward_only:
            self.deferred = {(mb, c) for mb, c in split_backwards(plan) if self.stores[c] is not None}
        nexts = next_comms(plan)
        for i, a in enumerate(plan):
            t = clock() if trace is not None else 0.0
            if a.kind == "F":
                self.forward(a.mb, a.chunk)
            elif a.kind == "B":
                self.backward(a.mb, a.chunk)
            elif a.kind == "W":
                self.weight(a.mb, a.chunk)
            else:
                self.exchange(a.ops, () if nexts[i] is None else plan[nexts[i]].ops)
            if trace is not None:
                trace.record(a, t, clock())
        self.comm.finish_sends()
        if self.to_send or self.edges or self.seeds or self.out_grads or self.handed or self.comm.receives_ahead or \
                any(s.pending() for s in self.stores if s is not None):
            raise RuntimeError("pipeline plan left work undone (internal error)")
        return self.losses


class PipelineRunner:
    """This rank's schedule for ``num_micro_batches`` micro-batches, built once per run (and once
    per other count a batch-size schedule asks for: the plans are kept per ``(M, forward_only)``).

    ``activation_shape`` / ``activation_dtype``: the tensor that travels between stages (and its
    gradient back), e.g. ``ModelStages.activation_shape``; ``device``: where receives are
    allocated (default: the chunks' device, read on the first :meth:`run`).  Holds
    ``plans[forward_only]`` and the communicator ``comm``.
    """

    def __init__(self, topo, num_micro_batches: int, activation_shape, activation_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        self.topo, self.m = topo, int(num_micro_batches)
        self.shape, self.dtype = tuple(activation_shape), activation_dtype
        self.plans = {(self.m, fo): self._plan(self.m, fo) for fo in (False, True)}
        self.schedule = schedule_name(topo.pp, topo.vp, _schedule(topo))
        self.warmup = warmup_count(topo.pp, topo.vp, self.m, topo.pp_rank)
        self.comm = P2PCommunicator(topo, self.shape, self.dtype, device) if device is not None else None

    def _plan(self, m: int, forward_only: bool):
        topo = self.topo
        return build_plan(topo.pp, topo.vp, m, topo.pp_rank, forward_only, schedule=_schedule(topo))

    def run(self, chunks, micro_batches, forward_step, grad_scale=1.0, forward_only: bool = False, trace=None,
            stats: dict | None = None, weight_grad_stores=None) -> list:
        """One step; returns the last virtual stage's per-micro-batch losses (detached), else ``[]``.

        ``chunks``: this rank's VP model chunks (a single module means VP = 1), in virtual-stage
        order (chunk ``c`` is virtual stage ``c * PP + pp_rank``).  ``micro_batches``: the step's
        ``M`` micro-batch dicts (every rank gets all of them; each stage uses what it needs).
        ``forward_step(chunk, micro_batch, input_tensor)`` returns the chunk's output, a scalar
        loss on the last virtual stage; ``input_tensor`` is ``None`` on the first virtual stage.
        ``grad_scale``: float or 0-dim tensor multiplying the loss's gradient (fp16 loss scale).
        ``forward_only``: no backward, no grad (evaluation).  ``trace``: a
        :class:`~megazero.pipeline.trace.ScheduleTrace` to record this step into (adds a barrier).
        ``stats``: a dict to receive ``schedule``, ``warmup``, ``max_in_flight``,
        ``deferred_weight_grads`` (weight gradients the step's ``W`` actions delivered).
        ``weight_grad_stores``: one :class:`~megazero.tensor_parallel.weight_grad_store.WeightGradStore`
        (or None) per chunk, attached to the chunk's layers (``ModelStages.weight_grad_stores``):
        a plan's ``W`` actions then compute the weight gradients its ``B`` deferred; without
        stores (or with plans without ``W``) every ``B`` computes all gradients, and ``W`` is
        nothing.
        """
        chunks = [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)
        micro_batches = list(micro_batches)
        if len(chunks) != self.topo.vp:
            raise ValueError(f"{len(chunks)} model chunks given, topology has VP {self.topo.vp}")
        key = (len(micro_batches), bool(forward_only))
        if key not in self.plans:  # a new batch size (validated for the schedule by the arguments)
            self.plans[key] = self._plan(*key)
        if self.comm is None:
            self.comm = P2PCommunicator(self.topo, self.shape, self.dtype, _device_of(chunks))
        stores = None if weight_grad_stores is None else list(weight_grad_stores)
        if stores is not None and len(stores) != len(chunks):
            raise ValueError(f"{len(stores)} weight-gradient stores given for {len(chunks)} model chunks")
        for store in stores or []:
            if store is not None:
                store.clear()  # nothing of a failed or discarded step survives into this one
        step = _Step(chunks, micro_batches, self.topo, forward_step, self.comm, grad_scale, forward_only, trace,
                     stores)
        with torch.no_grad() if forward_only else torch.enable_grad():
            losses = step.run(self.plans[key])
        if stats is not None:
            stats.update(schedule=self.schedule, max_in_flight=step.max_live, deferred_weight_grads=step.landed,
                         warmup=warmup_count(self.topo.pp, self.topo.vp, key[0], self.topo.pp_rank))
        return losses


def _schedule(topo) -> str | None:
    """The topology's ``pipeline_schedule`` (None: 1F1B / interleaved 1F1B by VP)."""
    return getattr(topo, "pipeline_schedule", None)


def _device_of(chunks) -> torch.device:
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def forward_backward(chunks, microbatches, topo, forward_step_func, tensor_shape, dtype,
                     grad_scale=1.0, forward_only: bool = False, trace=None, stats: dict | None = None,
                     weight_grad_stores=None):
    """One step with a runner built for it: ``PipelineRunner(topo, len(microbatches),
    tensor_shape, dtype).run(chunks, microbatches, forward_step_func, ...)`` (tests, benchmarks;
    training builds its runner once)."""
    microbatches = list(microbatches)
    runner = PipelineRunner(topo, len(microbatches), tensor_shape, dtype)
    return runner.run(chunks, microbatches, forward_step_func, grad_scale=grad_scale, forward_only=forward_only,
                      trace=trace, stats=stats, weight_grad_stores=weight_grad_stores)
