"""Token dispatch for MoE: send each (token, expert) pair to the rank holding the expert, bring
the weighted expert outputs back (Megatron-core's ``MoEAlltoAllTokenDispatcher`` and
``MoEAllGatherTokenDispatcher``, core_v0.20.0 ``token_dispatcher.py``).

Each rank enters with its own ``T`` tokens (under sequence parallelism the TP ranks hold
different pieces of the sequence). Expert ``e`` of ``E`` lives on EP rank ``e // (E / EP)``,
its weights split over the ``ETP`` ranks of that EP rank's expert-TP group. Both dispatchers
compute, for every token ``t`` and chosen expert ``e``, ``p_te * Expert_e(x_t)``, summed over
``e`` on the token's own rank:

* **alltoall**: :func:`permute` the local (token, expert) pairs by expert (so by destination
  EP rank), exchange counts, all-to-all the rows over the EP group, all-gather them over the
  expert-TP group (when ETP > 1), regroup by local expert, run the experts (ETP-partial outputs),
  reduce-scatter over ETP, all-to-all back, weight by ``p`` and add up per token
  (:func:`unpermute`). Volume per direction: the rows whose expert is on another EP rank,
  ``<= T k h`` elements (``T k (EP - 1) / EP h`` for uniform routing).
* **allgather**: all-gather tokens, weights and routing map over the expert-TP x EP group
  (``G`` ranks), each rank runs its local experts on every gathered token routed to them, and
  the weighted partial outputs are reduce-scattered back: ``(G - 1) T h`` per direction.

The split sizes of an exchange are read on the host once per alltoall layer call (dropless
routing has data-dependent sizes; Megatron-core's dispatcher reads them too), the local experts'
row counts once per allgather call: an MoE iteration makes these reads beyond the loop's one.
"""

from __future__ import annotations

import torch

from megazero.tensor_parallel import (all_gather_dim0, gather_from_sequence_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region)
from megazero.parallel.exchange import all_gather_v, all_to_all, exchange_counts, reduce_scatter_v
from megazero.tensor_parallel.mappings import group_size


def permute(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """``(rows, token_ids, weights, counts)``: the routed (token, expert) pairs grouped by expert
    (ascending), tokens in order within an expert; ``counts[e]`` pairs per expert."""
    mask = routing_map.t()  # [E, T]
    token_ids = torch.arange(x.shape[0], device=x.device).unsqueeze(0).expand_as(mask).masked_select(mask)
    weights = probs.t().masked_select(mask)
    return x.index_select(0, token_ids), token_ids, weights, mask.sum(dim=1)


def unpermute(rows: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``y[t] = sum over pairs (t, e) of w_te * rows_te`` (``[num_tokens, h]``)."""
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, token_ids, rows * weights.unsqueeze(-1).to(rows.dtype))


def _regroup(rows: torch.Tensor, block_counts: list[list[int]], by_expert: bool) -> torch.Tensor:
    """Rows in blocks ``(b, le)`` (``block_counts[b][le]`` rows each, b-major) reordered to
    le-major (``by_expert``) or back."""
    B, El = len(block_counts), len(block_counts[0])
    if by_expert:
        pieces = rows.split([block_counts[b][le] for b in range(B) for le in range(El)])
        return torch.cat([pieces[b * El + le] for le in range(El) for b in range(B)])
    pieces = rows.split([block_counts[b][le] for le in range(El) for b in range(B)])
    return torch.cat([pieces[le * B + b] for b in range(B) for le in range(El)])


def alltoall_dispatch(x, probs, routing_map, experts, ep_group, etp_group, stats: dict):
    """See the module doc. ``experts(rows, counts)`` runs the local experts on rows grouped by
    local expert. ``stats`` receives the rows sent to other EP ranks (``sent_rows``)."""
    EP, ETP = group_size(ep_group), group_size(etp_group)
    rows, token_ids, weights, counts = permute(x, probs, routing_map)
    El = counts.numel() // EP
    send = counts.view(EP, El)
    recv = exchange_counts(send, ep_group)  # [EP, El]: what each EP peer sends this rank per local expert
    if ETP > 1:  # the expert-TP peers' received counts too: they gather each other's rows
        recv = all_gather_dim0(recv.reshape(1, -1), etp_group).view(ETP * EP, El)
    table = torch.cat([send.flatten(), recv.flatten()]).tolist()  # the layer call's one host read
    send_l = [table[j * El:(j + 1) * El] for j in range(EP)]
    blocks = [table[EP * El + b * El:EP * El + (b + 1) * El] for b in range(len(table) // El - EP)]
    in_splits = [sum(r) for r in send_l]
    me_etp = torch.distributed.get_rank(etp_group) if ETP > 1 else 0
    out_splits = [sum(r) for r in blocks[me_etp * EP:(me_etp + 1) * EP]]
    me = torch.distributed.get_rank(ep_group) if EP > 1 else 0
    stats["sent_rows"] = sum(n for j, n in enumerate(in_splits) if j != me)
    got = all_to_all(rows, ep_group, out_splits, in_splits)
    sizes = None
    if ETP > 1:
        sizes = [sum(sum(b) for b in blocks[r * EP:(r + 1) * EP]) for r in range(ETP)]
        got = all_gather_v(got, etp_group, sizes)
    per_expert = [sum(b[le] for b in blocks) for le in range(El)]
    out = _regroup(experts(_regroup(got, blocks, True), per_expert), blocks, False)
    if sizes is not None:
        out = reduce_scatter_v(out, etp_group, sizes)
    back = all_to_all(out, ep_group, in_splits, out_splits)
    return unpermute(back, token_ids, weights, x.shape[0])


def allgather_dispatch(x, probs, routing_map, experts, group, local: tuple[int, int], stats: dict):
    """See the module doc. ``group``: the expert-TP x EP group; ``local``: this rank's expert range."""
    G = group_size(group)
    xs = gather_from_sequence_parallel_region(x, group)
    ps = gather_from_sequence_parallel_region(probs, group)
    maps = all_gather_dim0(routing_map.to(torch.uint8), group).bool() if G > 1 else routing_map
    lo, hi = local
    rows, token_ids, weights, counts = permute(xs, ps[:, lo:hi], maps[:, lo:hi])
    stats["sent_rows"] = (G - 1) * x.shape[0]
    out = unpermute(experts(rows, counts.tolist()), token_ids, weights, xs.shape[0])
    return reduce_scatter_to_sequence_parallel_region(out, group)
