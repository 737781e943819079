"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Every exchange of a schedule step is one ``torch.distributed.batch_isend_irecv`` call on the
pipeline-parallel group, waited on before the next compute (works on NCCL and on gloo: checked
with torch 2.13, so no fallback path exists).  Shapes and dtype are fixed by the arguments --
``[s, b, h]``, or ``[s / TP, b, h]`` with sequence parallelism (:func:`pipeline_tensor_shape`)
-- so receives are allocated up front and no shape handshake is ever sent.

Peers are pipeline ranks; the previous/next stage wraps round (``(r +- 1) % PP``), which is
how chunk ``c`` of the last rank feeds chunk ``c + 1`` of the first rank with virtual stages.
The i-th message on a (sender, receiver) channel is matched with the i-th receive posted for it
(the plans guarantee the two orders agree; see ``plan.simulate``).  Volume per micro-batch and
virtual-stage boundary: ``s b h / (TP if SP else 1)`` elements each way.
"""

from __future__ import annotations

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

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[int]) -> list[torch.Tensor]:
        """Post every send ``(tensor, peer pipeline rank)`` and one receive per peer in ``recvs``
        as one batch, wait for all of them, and return the received tensors in ``recvs`` order."""
        out = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in recvs]
        ops = []
        for tensor, peer in sends:
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise ValueError(f"pipeline rank {self.topo.pp_rank}: sending {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {self.shape} {self.dtype} (--seq-length/--micro-batch-size/--hidden-size)")
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer=self.ranks[peer], group=self.group))
        for buf, peer in zip(out, recvs):
            ops.append(dist.P2POp(dist.irecv, buf, peer=self.ranks[peer], group=self.group))
        if not ops:
            return out
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the peers named
            peers = sorted({self.ranks[p] for _, p in sends} | {self.ranks[p] for p in recvs})
            raise PipelineCommError(
                f"rank {self.topo.rank} (pipeline rank {self.topo.pp_rank}): p2p exchange with global rank(s) "
                f"{peers} failed -- a peer stage probably raised or died: {e}") from e
        return out

