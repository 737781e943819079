"""Split backward in one process (megazero.tensor_parallel.weight_grad_store): under a deferring
store the backward delivers input and bias gradients only; ``run(m)`` delivers micro-batch m's
weight gradients through each weight's own AccumulateGrad (its post-accumulate hook fires then,
once per weight, a tied weight's two uses summed), equal to an undivided backward; a fusion sink
is called at W, not at B; activation recompute takes the same path."""

import copy

import pytest
import torch
from torch import nn

from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, checkpoint
from megazero.tensor_parallel.weight_grad_store import WeightGradStore


class Tiny(nn.Module):
    """Embedding -> column -> tanh -> row (-> recomputed) -> tied output layer, TP = 1."""

    def __init__(self, recompute=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        init = lambda t: t.normal_(0.0, 0.3, generator=gen)  # noqa: E731
        self.emb = VocabParallelEmbedding(12, 8, None, init_method=init)
        self.col = ColumnParallelLinear(8, 6, None, bias=True, init_method=init)
        self.row = RowParallelLinear(6, 8, None, bias=False, init_method=init)
        self.out = ColumnParallelLinear(8, 12, None, bias=False, create_weight=False)
        self.recompute = recompute

    def block(self, h):
        return h + self.row(torch.tanh(self.col(h)))

    def forward(self, ids):
        h = self.emb(ids)
        h = checkpoint(self.block, None, h) if self.recompute else self.block(h)
        return torch.log_softmax(self.out(h, self.emb.weight), -1)[..., 0].sum()


def _batches(m):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 12, (3, 2), generator=g) for _ in range(m)]


def _hooked(model, log):
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: log.append((name, p.grad is None)))


@pytest.mark.parametrize("recompute", [False, True])
def test_b_leaves_weights_alone_and_w_lands_them_once(recompute):
    ref, model = Tiny(recompute), None
    model = copy.deepcopy(ref)
    store = WeightGradStore().attach(model)
    assert model.col.weight_grad_store is store and model.emb.weight_grad_store is store
    mbs = _batches(3)
    for ids in mbs:
        ref(ids).backward()
    log = []
    _hooked(model, log)
    losses = []
    for i, ids in enumerate(mbs):  # F0 F1 F2 B0 B1 B2 then W2 W0 W1: any order after the Bs
        with store.deferring(i):
            losses.append(model(ids))
    for i, loss in enumerate(losses):
        with store.deferring(i):
            loss.backward()
    assert log == [("col.bias", False)] * 3  # the bias's gradient stays in B; no weight's hook fired
    assert all(p.grad is None for n, p in model.named_parameters() if n.endswith("weight"))
    assert sorted(store.pending()) == [0, 1, 2]
    for i in (2, 0, 1):
        log.clear()
        assert store.run(i) == 3  # col, row, and the embedding's two uses landed as one
        assert sorted(log) == [("col.weight", False), ("emb.weight", False), ("row.weight", False)]
    assert store.pending() == []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_fusion_sink_is_called_at_w_and_hook_sees_no_grad():
    ref, model = Tiny(), Tiny()
    store = WeightGradStore().attach(model)
    main, calls = torch.zeros_like(model.col.weight), []

    def sink(weight, g2, x2):
        calls.append(weight is model.col.weight)
        main.addmm_(g2.t(), x2)
        return True
    model.col.accumulate_weight_grad_into(sink)
    log = []
    _hooked(model, log)
    ids = _batches(1)[0]
    ref(ids).backward()
    with store.deferring(0):
        model(ids).backward()
    assert calls == []
    store.run(0)
    assert calls == [True] and model.col.weight.grad is None and ("col.weight", True) in log
    assert not main.requires_grad  # W records no graph (the saved X requires grad): ZeRO's buffer stays plain
    torch.testing.assert_close(main, ref.col.weight.grad, rtol=1e-6, atol=1e-7)


def test_without_deferring_the_backward_is_whole_and_outside_use_is_refused():
    model = Tiny()
    store = WeightGradStore().attach(model)
    model(_batches(1)[0]).backward()  # store attached but off: today's backward
    assert model.col.weight.grad is not None and store.pending() == []
    with store.deferring(0):
        loss = model(_batches(1)[0])
    with pytest.raises(RuntimeError, match="outside WeightGradStore.deferring"):
        loss.backward()
    store.clear()
    assert store.pending() == []


def test_w_delivers_each_weight_before_computing_the_next():
    """One autograd call per W, yet each gradient reaches its hook (ZeRO takes it into the flat
    buffer) before the next is computed, in push order: one weight-sized gradient at a time."""
    ps = [nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    events = []
    for i, p in enumerate(ps):
        p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("hook", i)))
    store = WeightGradStore()
    with store.deferring(5):
        for i, p in enumerate(ps):
            store.push(p, lambda i=i: events.append(("compute", i)) or torch.full((4, 4), float(i)))
    assert store.run(5) == 3 and store.run(5) == 0
    assert events == [(k, i) for i in range(3) for k in ("compute", "hook")]
    assert [p.grad[0, 0].item() for p in ps] == [0.0, 1.0, 2.0]


def test_w_frees_each_weights_inputs_once_its_gradient_is_computed():
    """What a weight's dW needs (its closures over X and G) is dropped as soon as that dW is
    computed, before the next weight's: the W holds one weight's X and G at a time, not all."""
    import gc
    import weakref

    class Saved:  # stands in for a closure's X and G
        pass

    ps = [nn.Parameter(torch.randn(2, 2)) for _ in range(3)]
    store, refs, alive = WeightGradStore(), [], []

    def hook(_):
        gc.collect()
        alive.append([r() is not None for r in refs])
    for p in ps:
        p.register_post_accumulate_grad_hook(hook)
    with store.deferring(0):
        for p in ps:
            saved = Saved()
            refs.append(weakref.ref(saved))
            store.push(p, lambda saved=saved: torch.ones(2, 2))
            del saved
    store.run(0)
    assert alive == [[False, True, True], [False, False, True], [False, False, False]]
