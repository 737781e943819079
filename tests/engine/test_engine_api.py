"""megazero.initialize's API around the step: accumulation boundaries, a client torch optimizer
driven by a torch LR scheduler (= one-process torch), the config's scheduler block, and the
one-line errors (a parameter not in the module, a module changed after initialize, ranks with
different models, a config key refused)."""

from __future__ import annotations

import torch
from torch import nn

from megazero.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def _mlp(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def _data(world, steps=3, gas=2):
    g = torch.Generator().manual_seed(5)
    return [[[(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(gas)]
             for _ in range(world)] for _ in range(steps)]


def _client(rank, world, data):
    """A torch AdamW (two groups) and a LambdaLR built by the callable DeepSpeed accepts."""
    import megazero
    model = _mlp()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                             {"params": model[2].parameters(), "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2)
    engine, eopt, _, sched = megazero.initialize(
        model=model, optimizer=opt, config=dict(CFG, zero_optimization={"stage": 2}),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1.0 / (n + 1)))
    boundaries, lrs = [], []
    for step in data:
        for x, y in step[rank]:
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(((engine(x) - y) ** 2).mean())
            engine.step()
        lrs.append(engine.get_lr())
    return boundaries, lrs, engine.global_steps, engine.module_state_dict()


def test_client_optimizer_and_torch_scheduler_equal_one_process():
    data = _data(2)
    model = _mlp()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                             {"params": model[2].parameters(), "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    want_lrs = []
    for step in data:
        for rank in step:
            for x, y in rank:
                (((model(x) - y) ** 2).mean() / 4).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        want_lrs.append(sched.get_last_lr())
    for boundaries, lrs, steps, state in run_distributed(_client, 2, data, timeout_s=120):
        assert boundaries == [False, True] * 3 and steps == 3
        assert lrs == want_lrs
        for k, v in model.state_dict().items():
            assert (state[k] - v).abs().max() <= 1e-6 * v.abs().max(), k


def _warmup(rank, world):
    import megazero
    cfg = dict(CFG, optimizer={"type": "Adam", "params": {"lr": 1e-3}},
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, _, _, sched = megazero.initialize(model=_mlp(), config=cfg)
    lrs = [engine.get_lr()[0]]
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    for _ in range(10):
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs, type(sched).__name__


def test_config_warmup_lr_moves_at_boundaries_only():
    (lrs, kind), = run_distributed(_warmup, 1, timeout_s=60)
    # DeepSpeed WarmupLR linear, W = 4: step t trains with min + (max - min) * t / W, t = -1 -> min
    want = [0.0, 0.0, 0.0, 0.0, 2.5e-4, 2.5e-4, 5e-4, 5e-4, 7.5e-4, 7.5e-4, 1e-3]
    assert kind == "GroupLRScheduler" and all(abs(a - b) < 1e-12 for a, b in zip(lrs, want)), lrs


def _errors(rank, world):
    import megazero
    out = {}
    cfg = dict(CFG, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    for case in ("unregistered", "mutated", "refused", "ranks"):
        model = _mlp(8 + (case == "ranks") * rank)
        try:
            if case == "unregistered":
                megazero.initialize(model=model, model_parameters=[nn.Parameter(torch.zeros(3))], config=cfg)
            elif case == "refused":
                megazero.initialize(model=model, config=dict(cfg, prescale_gradients=True))
            else:
                engine, *_ = megazero.initialize(model=model, config=cfg)
                if case == "mutated":
                    model.append(nn.Linear(3, 3))
                    engine(torch.randn(2, 4))
            out[case] = None
        except (ValueError, RuntimeError) as e:
            out[case] = str(e)
    return out


def test_errors_are_one_line():
    for rank, out in enumerate(run_distributed(_errors, 2, timeout_s=120)):
        assert "model_parameters[0] (shape (3,)) is not a parameter registered in the model" in out["unregistered"]
        assert "parameters changed after initialize (added 3.weight)" in out["mutated"]
        assert "'prescale_gradients'" in out["refused"] and "changes training" in out["refused"]
        assert "rank 1's model differs from rank 0's" in out["ranks"] and "'0.weight:(8, 4)" in out["ranks"]
        assert all("\n" not in m for m in out.values())


class _Twice(nn.Module):
    """A block list whose first block runs twice per forward (weights used twice, a module
    called twice), and a head tied to the input embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = self.blocks[1](self.blocks[0](self.blocks[0](h)))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _twice(rank, world, data):
    import megazero
    engine, *_ = megazero.initialize(model=_Twice(), config=dict(CFG, optimizer={"type": "AdamW", "params": {
        "lr": 1e-2}}, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_max_reuse_distance": 0}))
    assert len(engine.zero.gatherer.units) == 2  # the two blocks; the root holds only the tied matrix (whole)
    losses = []
    for step in data:
        for ids in step[rank]:
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()  # an evaluation forward between steps gathers and releases as well
        with torch.no_grad():
            assert abs(engine(step[rank][0]).item() - losses[-2]) > 0  # the step changed the weights
        engine.train()
    return losses, engine.module_state_dict()


def test_module_called_twice_tied_weights_and_eval_at_zero3():
    g = torch.Generator().manual_seed(9)
    data = [[[torch.randint(0, 16, (2, 5), generator=g) for _ in range(2)] for _ in range(2)] for _ in range(3)]
    model = _Twice()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for step in data:
        for rank in step:
            for ids in rank:
                loss = model(ids)
                (loss / 4).backward()
                want.append(loss.item())
        opt.step()
        opt.zero_grad()
    for rank, (losses, state) in enumerate(run_distributed(_twice, 2, data, timeout_s=120)):
        mine = [want[s * 4 + rank * 2 + m] for s in range(3) for m in range(2)]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, mine)), (losses, mine)
        for k, v in model.state_dict().items():
            assert (state[k] - v).abs().max() <= 1e-5 * v.abs().max(), k
