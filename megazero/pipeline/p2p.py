"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

One posting for every schedule and every backend (so the gloo suite runs what NCCL runs):

* every message is a single ``torch.distributed.isend`` / ``irecv`` -- never a coalesced
  ``batch_isend_irecv`` -- on the communicator of its channel's class
  (:func:`.streams.channel_class`: 2, 4 or 6 groups over all ranks, made once per topology by
  :func:`channel_groups`), so that each rank's NCCL stream of a group carries one channel, one
  direction, in order -- whether torch runs single ops on the group's communicator (a default
  group bound to a device, as the launcher makes it) or on a two-rank one per pair (see
  :mod:`.streams`); Megatron gives one direction of a two-rank pipeline its own communicator for
  the same reason (megatron-core 0.16.1 pipeline_parallel/p2p_communication.py ``_p2p_ops``,
  lines 64-76, ``WORLD`` "to allow the overlap of the independent communications");
* an exchange posts its sends, then its receives (unless posted already), then the *next*
  exchange's receives, and waits for its own receives only: a receive is posted one compute
  ahead of its wait, so its transfer overlaps that compute (``torch.distributed.pipelining``
  posts receives as early as its schedule allows, ``_add_send_recv``; each channel's receives
  stay in order on its own stream, so this adds no wait to the stream model); the sends
  complete in the background and are waited for when the step ends (:meth:`finish_sends`), as
  ``torch.distributed.pipelining``'s runtime does for its zero-bubble schedules (torch 2.13
  pipelining/schedules.py: ``_PipelineScheduleRuntime._step_microbatches`` keeps ``send_ops``
  and waits them after the last action, lines 2440-2472 and 2654-2655; its ``_batch_p2p``, lines
  623-648, posts all-send or all-receive batches as single ops, uncoalesced);
* the first exchange sends one tiny message on each of the rank's channels, class by class, so
  no lazily created NCCL communicator blocks a rank's CPU in the middle of a step.

Why not Megatron's 1F1B pairing (``send_forward_recv_backward``: the step's send and receive in
one ``batch_isend_irecv``, waited whole): a coalesced batch is one NCCL group that completes only
when all its ops are matched, and the groups of a rank queue on one stream; the zero-bubble plans
send before their peer posts the matching receive and deadlock so (``interleaved-zb``, ``zbv``,
``dualpipev``), while single ops on a shared pair stream deadlock even 1F1B (both neighbours send
first), and so do two streams per rank (sends and receives, or up and down the pipeline: ZB).
:func:`.streams.check_streams` shows all of it on the plans, and that this posting is
deadlock-free for every schedule (``check_plans`` runs it before every run); gloo sends also
complete only when received, so the gloo tests run the same waits.

Shapes and dtype are fixed by the arguments -- ``[s, b, h]``, or ``[s / TP, b, h]`` with sequence
parallelism (:func:`pipeline_tensor_shape`) -- so receives are allocated up front and no shape
handshake is ever sent.  Peers are pipeline ranks; the previous/next stage wraps round
(``(r +- 1) % PP``), which is how chunk ``c`` of the last rank feeds chunk ``c + 1`` of the first
rank with virtual stages.  The i-th message on a channel is matched with the i-th receive posted
for it (the plans guarantee the two orders agree; see ``plan.simulate``).  Volume per
micro-batch and virtual-stage boundary: ``s b h / (TP if SP else 1)`` elements each way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from .streams import channel_class, channel_classes

GROUPS_KEY = "pp_channels"  # topo.groups entry holding the channel classes' process groups


class PipelineCommError(RuntimeError):
    """A point-to-point exchange failed or timed out; the message names the peers involved."""


def channel_groups(topo) -> tuple:
    """The process groups of the channel classes (``channel_classes(PP)`` of them, each over all
    ranks, with the backend and timeout of the topology's groups), created on first use -- a
    collective: every rank's first communicator is built at the same point of the run -- and kept
    in ``topo.groups`` for the topology's later runners."""
    if not topo.groups:
        raise RuntimeError("process groups not created; call Topology.create_groups() first")
    if GROUPS_KEY not in topo.groups:
        options = getattr(topo, "group_options", {})
        topo.groups[GROUPS_KEY] = tuple(dist.new_group(**options) for _ in range(channel_classes(topo.pp)))
    return topo.groups[GROUPS_KEY]


class P2PCommunicator:
    """Sends and receives fixed-shape tensors to/from pipeline ranks of ``topo``'s pp group."""

    def __init__(self, topo, tensor_shape, dtype: torch.dtype, device: torch.device | str):
        self.topo = topo
        self.shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.ranks = topo.rank_lists["pp"]
        self.groups = channel_groups(topo) if topo.pp > 1 else ()
        self._sent = []  # [(send work, the tensor it reads)] not yet seen complete
        self._ahead = {}  # key -> (receive work, buffer) posted ahead of its exchange
        self._connected = False

    def _group(self, src: int, dst: int):
        return self.groups[channel_class(self.topo.pp, src, dst)]

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple], ahead: list[tuple] = ()) \
            -> list[torch.Tensor]:
        """Post every send ``(tensor, peer pipeline rank)``, then the receives ``recvs`` -- ``(key,
        peer)`` pairs, ``key`` naming the message (``P2P.key``) -- each a single op on its
        channel's communicator unless an earlier exchange posted it ahead; then post ``ahead``
        (the next exchange's receives, ``(key, peer)``: their transfer overlaps the compute in
        between, as ``torch.distributed.pipelining`` posts its receives as early as it can); wait
        for ``recvs`` only and return their tensors in order.  A channel's receives are so still
        posted in its order.  The sends complete in the background (a zero-bubble plan may send
        before its peer posts the receive): each is kept, with the storage it reads, until
        :meth:`finish_sends` (or a later exchange) sees it done."""
        for tensor, _ in sends:
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise ValueError(f"pipeline rank {self.topo.pp_rank}: sending {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {self.shape} {self.dtype} (--seq-length/--micro-batch-size/--hidden-size)")
        self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
        if not sends and not recvs and not ahead:
            return []
        me = self.topo.pp_rank
        peers = sorted({self.ranks[p] for _, p in [*sends, *recvs, *ahead]})
        with self._named(peers):
            if not self._connected:
                self._connect()
            for tensor, peer in sends:
                # an alias: the caller may swap the sent tensor's storage out, the alias keeps it
                t = tensor.detach().contiguous()
                self._sent.append((dist.isend(t, dst=self.ranks[peer], group=self._group(me, peer)), t))
            posted = [self._ahead.pop(key) if key in self._ahead else self._post_recv(peer) for key, peer in recvs]
            for key, peer in ahead:
                if key not in self._ahead:
                    self._ahead[key] = self._post_recv(peer)
            for work, _ in posted:
                work.wait()
        return [buf for _, buf in posted]

    def _post_recv(self, peer: int) -> tuple:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        me = self.topo.pp_rank
        return dist.irecv(buf, src=self.ranks[peer], group=self._group(peer, me)), buf

    @property
    def receives_ahead(self) -> int:
        """Receives posted ahead and not yet taken by an exchange (0 after a whole step)."""
        return len(self._ahead)

    def _connect(self) -> None:
        """One message on each of this rank's channels (to and from ``(r +- 1) % PP``), class by
        class: each channel's communicator exists afterwards (NCCL makes a lazy one at a pair's
        first op, blocking both CPUs until both arrive), and the lowest class with a rank still
        at it has both ends of its channel there, so this cannot block."""
        me, pp = self.topo.pp_rank, self.topo.pp
        chans = {(me, n) for n in ((me - 1) % pp, (me + 1) % pp) if n != me}
        chans |= {(n, me) for _, n in chans}
        for src, dst in sorted(chans, key=lambda c: channel_class(pp, *c)):
            buf = torch.zeros(1, dtype=self.dtype, device=self.device)
            if src == me:
                dist.isend(buf, dst=self.ranks[dst], group=self._group(src, dst)).wait()
            else:
                dist.irecv(buf, src=self.ranks[src], group=self._group(src, dst)).wait()
        self._connected = True

    @property
    def sends_in_flight(self) -> int:
        """Sends posted and not yet waited for (0 after :meth:`finish_sends`)."""
        return len(self._sent)

    def finish_sends(self) -> None:
        """Wait for every send still in flight (the end of a step)."""
        sent, self._sent = self._sent, []
        with self._named(sorted({self.ranks[p] for p in range(self.topo.pp)} - {self.topo.rank})):
            for work, _ in sent:
                work.wait()

    @contextmanager
    def _named(self, peers):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - re-raised with the peers named
            raise PipelineCommError(
                f"rank {self.topo.rank} (pipeline rank {self.topo.pp_rank}): p2p exchange with global rank(s) "
                f"{peers} failed -- a peer stage probably raised or died: {e}") from e
