"""megazero's Muon against DeepSpeed 0.19.8's (CPU accelerator).

* the arithmetic: ``optim.muon`` in the ``deepspeed`` / ``deepspeed_gram`` flavours equals
  DeepSpeed's ``muon_update`` (momentum and update) bit for bit when DeepSpeed's functions run
  eagerly, and its ``torch.compile``d functions (what DeepSpeed runs) within 1e-5 for ``gram``
  (fp32 on this CPU; inductor fuses the elementwise steps, the momentum's lerp too);
* the parameter split: ``engine/muon.py`` tags what ``deepspeed.set_optimizer_flags`` tags;
* end to end: ``megazero.initialize`` and ``deepspeed.initialize`` with the same Muon ds_config at
  ZeRO 0, DP 2, on a tiny GPT2LMHeadModel: every micro-batch loss within 1e-4. Not 1e-5: Newton-
  Schulz multiplies the small singular values of its input ~500-fold, so last-bit differences in
  the gradients and the Adam half (1e-7 after the first step) come back in the losses at ~1e-5
  (measured: 1.3e-5 at one micro-batch, 1e-7 to 1e-6 at the others; the same 1.28e-5 with
  DeepSpeed's ``torch.compile`` disabled, so not its compiled kernels).
"""

import pytest
import torch

from megazero.optim.muon import MuonSettings, momentum_input, orthogonalize


def _ours(method):
    flavour = "deepspeed_gram" if method == "gram" else "deepspeed"
    return MuonSettings(momentum=0.9, flavour=flavour, ns_dtype=None if method == "gram" else torch.bfloat16)


def _compare(update_fn, method, tol):
    g = torch.Generator().manual_seed(0)
    s = _ours(method)
    for shape in [(16, 40), (40, 16), (24, 24)]:
        theirs_m, ours_m = torch.zeros(shape), torch.zeros(shape)
        for _ in range(3):
            grad = torch.randn(*shape, generator=g)
            theirs = update_fn(grad.clone(), theirs_m, beta=0.9, ns_method=method)
            u = momentum_input([grad.clone().reshape(-1)], [ours_m.view(-1)], [None], s, 0.0)[0]
            ours = orthogonalize(u.view(shape), s)
            assert (theirs - ours).abs().max() <= tol, (method, shape)
            assert (theirs_m - ours_m).abs().max() <= tol, (method, shape)


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_arithmetic_equals_deepspeeds_eager_functions(method, monkeypatch):
    import deepspeed.runtime.zero.muon.original_muon as om
    for name in ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
        monkeypatch.setattr(om, name, getattr(om, name)._torchdynamo_orig_callable)
    _compare(om.muon_update._torchdynamo_orig_callable, method, 0.0)


def test_gram_equals_deepspeeds_compiled_function():
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    _compare(muon_update, "gram", 1e-5)


def test_parameter_split_is_deepspeeds():
    from types import SimpleNamespace

    import deepspeed

    from megazero.engine.muon import muon_groups
    from megazero.config.deepspeed_muon import halves
    from tests.engine.hf_tiny import build, groups
    model = build("gpt2")
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    ours = {id(p) for g in muon_groups(model, groups(model), halves({})) if g["use_muon"] for p in g["params"]}
    theirs = {id(p) for p in model.parameters() if p.use_muon}
    assert ours == theirs and 0 < len(ours) < len(list(model.parameters()))


def _worker(rank, world, system, data):
    import warnings
    warnings.filterwarnings("ignore")
    from tests.engine.hf_tiny import build, groups
    from tests.engine.test_engine_muon import config
    model = build("gpt2")
    if system == "megazero":
        import megazero
        engine = megazero.initialize(model=model, model_parameters=groups(model), config=config(0))[0]
    else:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        engine = deepspeed.initialize(model=model, model_parameters=groups(model), config=config(0))[0]
    from tests.engine.hf_tiny import engine_losses
    return engine_losses(engine, data, rank)


def test_engine_losses_equal_deepspeeds_muon(deepspeed_ranks):
    from tests.engine.hf_tiny import batches
    from tests.engine.test_engine_muon import GAS, STEPS
    data = batches("gpt2", STEPS, 2, GAS)
    ours = deepspeed_ranks(_worker, 2, "megazero", data, timeout_s=600)
    theirs = deepspeed_ranks(_worker, 2, "deepspeed", data, timeout_s=600)
    worst = max(abs(a - b) / abs(b) for r in range(2) for a, b in zip(ours[r], theirs[r]))
    assert worst <= 1e-4, (worst, ours, theirs)
    assert ours[0][-1] != ours[0][0]
