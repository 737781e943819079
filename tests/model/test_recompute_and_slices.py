"""Recompute on/off and pipeline slices give the same model.

* Recompute (full uniform / block, selective) with hidden and attention dropout on: losses and
  every gradient bitwise equal to no recompute, over two steps (the RNG tracker continues the
  same way), at TP = 1 and at TP = 2 with sequence parallelism.
* A model built as two slices (layers 0..k with the embedding, k..L with the head), chained,
  gives the full model's loss and gradients; with tied embeddings the last slice's output weight
  starts equal to the embedding and the two slices' gradients of it sum to the full model's.
"""

import torch

from megazero.model import GPTConfig, GPTModel
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8,
            make_vocab_size_divisible_by=4, attention_dropout=0.2, hidden_dropout=0.2)
LLAMA = dict(BASE, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, untie_embeddings_and_output_weights=True)
RECOMPUTE = [dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
             dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
             dict(recompute_granularity="selective")]


def _two_steps(model, ids, labels):
    out = []
    for _ in range(2):
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss.mean().backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _recompute(rank, world):
    topo = Topology(world, rank, tp=world).create_groups() if world > 1 else None
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    checked = 0
    for kw in (BASE, LLAMA):
        sp = dict(sequence_parallel=world > 1)
        ref = _two_steps(GPTModel(GPTConfig(**kw, **sp), topo).train(), ids, labels)
        assert not torch.equal(ref[0][0], ref[1][0])  # dropout masks differ between steps
        for rc in RECOMPUTE:
            got = _two_steps(GPTModel(GPTConfig(**kw, **sp, **rc), topo).train(), ids, labels)
            for (loss, grads), (ref_loss, ref_grads) in zip(got, ref):
                assert torch.equal(loss, ref_loss), rc
                for name, g in ref_grads.items():
                    assert torch.equal(grads[name], g), (rc, name)
            checked += 1
    return checked


def test_recompute_single_process():
    assert _recompute(0, 1) == 2 * len(RECOMPUTE)


def test_recompute_tp2_sequence_parallel():
    assert run_distributed(_recompute, 2) == [2 * len(RECOMPUTE)] * 2


def _slices(rank, world):
    topo = Topology(world, rank, tp=world).create_groups() if world > 1 else None
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    for kw in (BASE, LLAMA):
        config = GPTConfig(**dict(kw, attention_dropout=0.0, hidden_dropout=0.0), sequence_parallel=world > 1)
        full = GPTModel(config, topo)
        full(ids, labels=labels).mean().backward()
        first = GPTModel(config, topo, layer_end=1, post_process=False)
        last = GPTModel(config, topo, layer_start=1, pre_process=False)
        hidden = first(ids)
        sent = hidden.detach().requires_grad_(True)  # as if over p2p
        loss = last(sent, labels=labels)
        loss.mean().backward()
        hidden.backward(sent.grad)
        torch.testing.assert_close(loss, full(ids, labels=labels), rtol=1e-6, atol=1e-6)
        grads = {n: p.grad for m in (first, last) for n, p in m.named_parameters()}
        shared = first.shared_embedding_weight(), last.shared_embedding_weight()
        if config.tied_embeddings:
            assert torch.equal(shared[0], shared[1]) and full.shared_embedding_weight() is None
            grads["embedding.word_embeddings.weight"] = shared[0].grad + grads.pop("output_layer.weight")
        else:
            assert shared == (None, None)
        full_grads = dict((n, p.grad) for n, p in full.named_parameters())
        assert grads.keys() == full_grads.keys()
        for name, g in full_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
    return True


def test_pipeline_slices_single_process():
    assert _slices(0, 1)


def test_pipeline_slices_tp2_sequence_parallel():
    assert run_distributed(_slices, 2) == [True, True]
