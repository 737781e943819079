"""Which parameters Muon steps (Megatron-LM's split) and how each is laid out over TP.

Megatron (``megatron/core/optimizer/emerging_optimizers.py`` at d98e8a6: ``_is_nonlinear_or_embedding``)
routes to Adam every parameter marked ``is_embedding_or_output_parameter`` (the word and
position embeddings and the output layer: ``ModelStages.decoupled_lr_params`` here) or whose
shape is not 2-D (norms, biases); every other 2-D weight is Muon's: the QKV, attention output,
MLP and routed-expert matrices (one matrix per expert), the router's weight. ``--muon-split-qkv``
(Megatron's default): the QKV matrix is orthogonalized as its Q, K and V row blocks apart (the
TP split's logical blocks of the attention's ``qkv.weight``; Megatron splits its per-group
interleaved rows the same way; NS commutes with row permutations, so the blocks are the same
matrices).
"""

from __future__ import annotations

from megazero.tensor_parallel.spec import named_tp_params
from megazero.zero.muon_shards import MuonMatrix


def muon_matrices(stages, topo, split_qkv: bool) -> dict:
    """``{param: MuonMatrix}`` of the chunks' Muon parameters (module docstring)."""
    adam = {id(p) for p in stages.decoupled_lr_params}
    experts = {id(p) for p in stages.expert_params}
    out = {}
    for chunk in stages.chunks:
        for name, _, _, p, split in named_tp_params(chunk):
            if not p.requires_grad or p.dim() != 2 or id(p) in adam:
                continue
            group = topo.expert_group("etp") if id(p) in experts else topo.tp_group
            blocks = None
            if split_qkv and name.endswith("qkv.weight") and split is not None and split.dim == 0:
                blocks = split.partition_sizes
            out[p] = MuonMatrix(split=split, tp_group=group if split is not None else None, row_blocks=blocks)
    return out
