"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Every exchange of a schedule step is one ``torch.distributed.batch_isend_irecv`` call on the
pipeline-parallel group whose receives are waited on before the next compute; its sends complete
in the background and are waited on at the end of the step (a zero-bubble plan may send before
the peer posts the matching receive, as ``torch.distributed.pipelining`` does; works on NCCL and
on gloo: checked with torch 2.13, so no fallback path exists).  Shapes and dtype are fixed by the arguments --
``[s, b, h]``, or ``[s / TP, b, h]`` with sequence parallelism (:func:`pipeline_tensor_shape`)
-- so receives are allocated up front and no shape handshake is ever sent.

Peers are pipeline ranks; the previous/next stage wraps round (``(r +- 1) % PP``), which is
how chunk ``c`` of the last rank feeds chunk ``c + 1`` of the first rank with virtual stages.
The i-th message on a (sender, receiver) channel is matched with the i-th receive posted for it
(the plans guarantee the two orders agree; see ``plan.simulate``).  Volume per micro-batch and
virtual-stage boundary: ``s b h / (TP if SP else 1)`` elements each way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist


class PipelineCommError(RuntimeError):
    """A point-to-point exchange failed or timed out; the message names the peers involved."""


class P2PCommunicator:
    """Sends and receives fixed-shape tensors to/from pipeline ranks of ``topo``'s pp group."""

    def __init__(self, topo, tensor_shape, dtype: torch.dtype, device: torch.device | str):
        self.topo = topo
        self.shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = topo.pp_group if topo.pp > 1 else None
        self.ranks = topo.rank_lists["pp"]
        self._sent = []  # [(send work, the tensor it reads)] not yet seen complete

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[int]) -> list[torch.Tensor]:
        """Post every send ``(tensor, peer pipeline rank)`` and one receive per peer in ``recvs``
        as one batch, wait for the receives, and return the received tensors in ``recvs`` order.
        The sends complete in the background (a zero-bubble plan may send before its peer posts
        the receive: ``plan.simulate``'s model): each is kept, with the storage it reads, until
        :meth:`finish_sends` (or a later exchange) sees it done. A backend that coalesces the
        batch into one work (NCCL) is waited for whole, sends included (1F1B's pairing needs
        them in one batch); the zero-bubble plans are untested there (no GPU in these runs)."""
        out = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in recvs]
        ops = []
        for tensor, peer in sends:
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise ValueError(f"pipeline rank {self.topo.pp_rank}: sending {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {self.shape} {self.dtype} (--seq-length/--micro-batch-size/--hidden-size)")
            # an alias: the caller may swap the sent tensor's storage out, the alias keeps it
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer=self.ranks[peer], group=self.group))
        for buf, peer in zip(out, recvs):
            ops.append(dist.P2POp(dist.irecv, buf, peer=self.ranks[peer], group=self.group))
        self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
        if not ops:
            return out
        peers = sorted({self.ranks[p] for _, p in sends} | {self.ranks[p] for p in recvs})
        with self._named(peers):
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # a coalescing backend (NCCL): one work for the batch
                for work in works:
                    work.wait()
                return out
            self._sent += [(w, op.tensor) for w, op in zip(works, ops) if op.op is dist.isend]
            for work in works[len(sends):]:
                work.wait()
        return out

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
