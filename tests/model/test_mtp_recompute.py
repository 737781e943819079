"""Multi-token prediction under full activation recompute (megazero.model.mtp), as megatron-core
0.16.1's ``MultiTokenPredictionLayer._checkpointed_forward``:

* uniform, one layer: losses (LM and each depth's MTP loss) and every gradient bitwise equal to no
  recompute over two steps with hidden and attention dropout on (the RNG replay), at one process
  and at TP 2 with SP, dense and MoE MTP layers; PP 2 (1F1B and zb-h1), TP 2 (SP) and an MoE
  model at PP 2 x EP 2, at ZeRO 1 and 3, equal one process without recompute;
* the recompute happens: in backward the MTP layers' ``enorm``/``hnorm``/``eh_proj``/transformer
  layer run a second time, their ``final_norm`` and the embedding do not, and the tensors kept for
  backward shrink (saved-tensor hooks) against the block method, which does not recompute MTP;
* block: no MTP recompute (the flag check's warning: tests/megatron/test_mtp_flags.py); uniform
  with more than one layer: refused.
"""

from __future__ import annotations

import pytest
import torch

from megazero.model import GPTModel
from megazero.parallel.topology import Topology
from megazero.testing import run_distributed
from tests.model.test_mtp import DENSE, _layouts
from tests.moe.helpers import gpt_batches, moe_config, reference

DROP = dict(hidden_dropout=0.1, attention_dropout=0.1)
MOE_MTP = dict(DROP, mtp_num_layers=2, untie_embeddings_and_output_weights=True, position_embedding_type="rope")
UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)


def _two_steps(model, tokens, labels):
    """Two forward/backward passes: (LM losses, MTP losses, every gradient) of each."""
    model.moe_state.set_aux_scale(1.0)
    out = []
    for _ in range(2):
        model.zero_grad()
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        mtp = model.moe_state.take()["mtp_loss"][:model.config.mtp_num_layers]
        out.append((loss.detach(), mtp, {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _equal_with_and_without(rank, world):
    torch.set_num_threads(1)
    topo = Topology(world, rank, tp=world).create_groups() if world > 1 else None
    text = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    tokens, labels = text[:, :-1], text[:, 1:]
    checked = 0
    for kw in (dict(DENSE, **DROP), MOE_MTP):
        kw = dict(kw, sequence_parallel=world > 1)
        ref = _two_steps(GPTModel(moe_config(**kw), topo).train(), tokens, labels)
        assert not torch.equal(ref[0][0], ref[1][0])  # the dropout masks differ between the steps
        got = _two_steps(GPTModel(moe_config(**kw, **UNIFORM), topo).train(), tokens, labels)
        for (loss, mtp, grads), (ref_loss, ref_mtp, ref_grads) in zip(got, ref):
            assert torch.equal(loss, ref_loss) and torch.equal(mtp, ref_mtp) and mtp.min() > 1.0, (mtp, ref_mtp)
            assert grads.keys() == ref_grads.keys() and any(n.startswith("mtp.layers.1.") for n in grads)
            for name, g in ref_grads.items():
                assert torch.equal(grads[name], g), name
        checked += 1
    return checked


def test_recompute_equals_none_single_process_with_dropout():
    assert _equal_with_and_without(0, 1) == 2


def test_recompute_equals_none_tp2_sequence_parallel_with_dropout():
    assert run_distributed(_equal_with_and_without, 2) == [2, 2]


@pytest.mark.parametrize("sizes,overrides", [
    (dict(pp=2), DENSE),
    (dict(tp=2), dict(DENSE, sequence_parallel=True)),
    (dict(pp=2, pipeline_schedule="zb-h1"), DENSE),
    (dict(pp=2, ep=2), dict(MOE_MTP, hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=1)),
], ids=["pp2", "tp2-sp", "pp2-zb-h1", "moe-pp2-ep2"])
def test_recompute_layout_equals_one_process_without(sizes, overrides):
    """ZeRO 1 and 3 (the MTP layers' parameters gathered again for the recompute); zero-bubble's
    split backward (weight gradients at W); an MoE MTP layer over EP 2."""
    dp = 4 // (sizes.get("tp", 1) * sizes.get("pp", 1))
    data = gpt_batches(2, dp, 2)
    ref_mtp = []
    ref, _ = reference(data, mtp_log=ref_mtp, **{k: v for k, v in overrides.items() if k != "sequence_parallel"})
    results = run_distributed(_layouts, 4, sizes, (1, 3), data, dict(overrides, **UNIFORM), timeout_s=300)
    for s in range(2):
        losses = next(r[s][0] for r in results if r[s][0] is not None)
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)
        mtp = results[0][s][1]
        assert max(abs(a - b) for x, y in zip(mtp, ref_mtp) for a, b in zip(x, y)) < 1e-5, (mtp, ref_mtp)


def _calls_and_saved_bytes(recompute):
    """Forward calls of each watched module over one forward + backward, and the bytes autograd
    kept for backward outside any checkpoint (a checkpoint's own hooks take what is inside)."""
    torch.manual_seed(0)
    model = GPTModel(moe_config(**DENSE, **recompute)).train()
    model.moe_state.set_aux_scale(1.0)
    watched = {"embedding": model.embedding, "layer0": model.layers["0"]}
    for k, layer in enumerate(model.mtp.layers):
        watched.update({f"{k}.{part}": getattr(layer, part)
                        for part in ("enorm", "hnorm", "eh_proj", "transformer_layer", "final_norm")})
    calls = dict.fromkeys(watched, 0)
    for name, module in watched.items():
        # a pre-hook: torch's checkpoint stops a recompute once it has the tensors backward needs
        module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t
    text = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(text[:, :-1], labels=text[:, 1:]).mean()
    loss.backward()
    return calls, saved[0]


def test_recompute_reruns_the_mtp_layers_in_backward_and_keeps_less():
    uniform, uniform_bytes = _calls_and_saved_bytes(UNIFORM)
    block, block_bytes = _calls_and_saved_bytes(BLOCK)
    none, none_bytes = _calls_and_saved_bytes({})
    D = DENSE["mtp_num_layers"]
    assert none == dict.fromkeys(none, 1) | {"embedding": 1 + D}
    recomputed = {f"{k}.{p}" for k in range(D) for p in ("enorm", "hnorm", "eh_proj", "transformer_layer")}
    assert uniform == {n: 2 if n in recomputed or n == "layer0" else c for n, c in none.items()}
    assert block == {n: 2 if n == "layer0" else c for n, c in none.items()}  # block: the decoder layers only
    # the decoder's layers are checkpointed alike in both: the difference is the MTP layers' activations
    assert uniform_bytes < block_bytes < none_bytes
    assert block_bytes - uniform_bytes > D * 16 * (8 * 2 * 16 * 4)  # per depth: >= 16 [s, b, h] fp32 tensors kept


def test_uniform_recompute_of_several_layers_is_refused_by_the_model():
    with pytest.raises(ValueError, match=r"--mtp-num-layers 2 with --recompute-method uniform --recompute-num-layers "
                                         r"2: .*use --recompute-num-layers 1"):
        GPTModel(moe_config(**DENSE, **dict(UNIFORM, recompute_num_layers=2)))
    assert GPTModel(moe_config(**DENSE, **UNIFORM)).mtp.recompute
    assert not GPTModel(moe_config(**DENSE, recompute_granularity="selective")).mtp.recompute
