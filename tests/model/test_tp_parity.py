"""TP = 1, 2, 4 (with and without sequence parallelism) equal the single-process model.

For a GPT-2-style and a Llama-style config: logits (gathered over the vocabulary), per-token
loss and every parameter's gradient (gathered to the full tensor) match the TP = 1 model.
Tolerance: max |a - b| / max |b| <= 1e-5 in fp32; in bf16 (TP = N vs TP = 1, both bf16)
norm-relative error ||a - b|| / ||b|| <= 1e-2 for logits/loss and 4e-2 for gradients (bf16 has
8 mantissa bits; the TP reductions sum in a different order).
"""

import torch

from megazero.model import GPTConfig, GPTModel
from megazero.tensor_parallel import gather_from_tp_region
from megazero.testing import run_distributed
from megazero.parallel.topology import Topology

ARCHS = {
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=8,
                 make_vocab_size_divisible_by=8, activation="gelu_tanh", attention_dropout=0.0, hidden_dropout=0.0),
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, vocab_size=100,
                  seq_length=8, make_vocab_size_divisible_by=8, position_embedding_type="rope",
                  normalization="RMSNorm", activation="swiglu", ffn_hidden_size=48, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0),
}


def _step(model, ids, labels, group, vocab):
    logits = gather_from_tp_region(model(ids), group)[..., :vocab].detach()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return logits, loss.detach(), model.full_state_dict(grads=True)


def _max_rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _norm_rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _parity(rank, world, dtype):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    labels = torch.randint(0, 100, (2, 8))
    errors = {}
    topos = {tp: Topology(world, rank, tp=tp).create_groups() for tp in (1, 2, 4)}
    for arch, kw in ARCHS.items():
        ref_model = GPTModel(GPTConfig(**kw, params_dtype=dtype))
        ref = _step(ref_model, ids, labels, None, 100)
        for tp, topo in topos.items():
            for sp in (False, True) if tp > 1 else (False,):
                model = GPTModel(GPTConfig(**kw, params_dtype=dtype, sequence_parallel=sp), topo)
                got = _step(model, ids, labels, topo.tp_group, 100)
                dup = {id(p) for p in model.tp_duplicated_parameters()}
                for name, p in model.named_parameters():  # replicated iff its full shape is local
                    assert (id(p) in dup) == (tp > 1 and p.shape == ref_model.get_parameter(name).shape
                                              and "word_embeddings" not in name and "output_layer" not in name)
                key = f"{arch} tp{tp} sp{int(sp)}"
                metric = _max_rel if dtype == torch.float32 else _norm_rel
                errors[f"{key} logits"] = metric(got[0], ref[0])
                errors[f"{key} loss"] = metric(got[1], ref[1])
                assert got[2].keys() == ref[2].keys()
                for name in ref[2]:
                    errors[f"{key} grad {name}"] = metric(got[2][name], ref[2][name])
    return errors


def _check(errors, logits_tol, grad_tol):
    bad = {k: v for k, v in errors.items() if v > (grad_tol if " grad " in k else logits_tol)}
    assert not bad, bad
    assert len(errors) > 50


def test_tp_parity_fp32():
    for errors in run_distributed(_parity, 4, torch.float32):
        _check(errors, 1e-5, 1e-5)


def test_tp_parity_bf16():
    for errors in run_distributed(_parity, 4, torch.bfloat16):
        _check(errors, 1e-2, 4e-2)
