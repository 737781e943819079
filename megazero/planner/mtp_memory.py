"""Multi-token prediction in the planner (:mod:`megazero.model.mtp`): the last pipeline rank holds
``D`` more transformer layers -- global layers ``L .. L + D - 1``, MoE when the last decoder layer is
(:meth:`~megazero.moe.config.MoEConfig.is_moe`) -- counted as layers, plus per depth the ``enorm``,
``hnorm`` and final norm and ``eh_proj`` (``2h x h``, column-parallel), and with PP > 1 the copy of
the word embedding (``V' / TP x h``) that stage embeds the shifted tokens with. Activations: per
depth one more layer's kept activations for each micro-batch in flight there and one more set of
output terms (``4 s b V' / TP``, the logits and their softmax for the cross entropy)."""

from __future__ import annotations


def mtp_layers(shape) -> list[int]:
    """The global numbers of the MTP layers' transformer layers (empty without MTP)."""
    return list(range(shape.num_layers, shape.num_layers + (shape.mtp_num_layers or 0)))


def mtp_extra_params(shape, tp: int, pp: int) -> int:
    """The MTP parameters of the last rank outside its transformer layers (see the module doc)."""
    D, h = shape.mtp_num_layers or 0, shape.hidden_size
    if not D:
        return 0
    norm = 2 * h if shape.layernorm else h
    copy = shape.padded_vocab(tp) // tp * h if pp > 1 else 0
    return D * (3 * norm + 2 * h * h // tp) + copy


def mtp_activation_bytes(shape, layer_kept: float, in_flight: int, s: int, b: int, tp: int) -> float:
    """The last rank's extra activations (2-byte units) for ``layer_kept`` per MTP layer and micro-batch."""
    D = shape.mtp_num_layers or 0
    return D * (in_flight * layer_kept + 4 * s * b * shape.padded_vocab(tp) / tp)
