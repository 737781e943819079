"""Megatron's log-line format (parsers depend on it) and the model-FLOPs formula."""

import re
import sys
import types
from types import SimpleNamespace

from megazero.model import GPTConfig
from megazero.config.configs import WandbConfig
from megazero.training.logger import (TensorBoardLogger, iteration_line, model_flops_per_iteration, open_wandb,
                                     validation_line)

EXAMPLE = (" iteration      100/    1000 | consumed samples:         3200 | elapsed time per iteration (ms): 512.3 |"
           " throughput per GPU (TFLOP/s/GPU): 0.1 | learning rate: 2.999999E-04 | global batch size:    32 |"
           " lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
           " number of nan iterations:   0 |")


def test_iteration_line_matches_megatron_byte_for_byte():
    line = iteration_line(iteration=100, train_iters=1000, consumed_samples=3200, iteration_ms=512.3,
                          tflops_per_gpu=0.1, lr=2.999999e-4, global_batch_size=32, losses={"lm loss": 5.123456},
                          loss_scale=1.0, grad_norm=1.234, skipped=0, nans=0)
    assert line == EXAMPLE


def test_validation_line():
    text = validation_line(7, 2.0)
    assert re.search(r"validation loss at iteration 7 \| lm loss value: 2\.000000E\+00 \| lm loss PPL: 7\.389056E\+00",
                     text)


def test_flops_formula_gpt3_style():
    c = GPTConfig(seq_length=2048, num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                  kv_channels=128, ffn_hidden_size=8192, vocab_size=50257)
    assert c.padded_vocab(1) == 50304
    f = model_flops_per_iteration(c, batch_size=1)
    # 6 * N * tokens (N ~ 1.3B incl. embedding) plus attention, per token ~ 8.5-9.5 GFLOP
    assert 8.0e9 * 2048 < f < 1.0e10 * 2048


def test_num_zeros_and_params_norm_fields_in_megatrons_order():
    """core_v0.15.0 training_log: ... grad norm | num zeros (the float .item() gives) | params norm | ..."""
    line = iteration_line(iteration=2, train_iters=10, consumed_samples=24, iteration_ms=10.0, tflops_per_gpu=None,
                          lr=1e-3, global_batch_size=12, losses={}, loss_scale=1.0, grad_norm=0.5, skipped=0, nans=0,
                          num_zeros=17, params_norm=12.3456)
    assert line.endswith(" grad norm: 0.500 | num zeros: 17.0 | params norm: 12.346 |"
                         " number of skipped iterations:   0 | number of nan iterations:   0 |")
    assert "num zeros" not in iteration_line(iteration=2, train_iters=10, consumed_samples=24, iteration_ms=10.0,
                                             tflops_per_gpu=None, lr=1e-3, global_batch_size=12, losses={},
                                             loss_scale=1.0, grad_norm=None, skipped=1, nans=0, num_zeros=None)


class FakeWandb(types.ModuleType):
    """Records what megazero sends to the wandb module's init/log/finish."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


def _wandb_args(tmp_path, **kw):
    """open_wandb's (W&B settings, --save, the flags) for these Megatron-named values."""
    a = {"wandb_project": "proj", "wandb_exp_name": "run1", "wandb_save_dir": None, "wandb_entity": None,
         "save": str(tmp_path / "ck"), "lr": 0.1, **kw}
    return (WandbConfig(project=a["wandb_project"], exp_name=a["wandb_exp_name"], save_dir=a["wandb_save_dir"],
                        entity=a["wandb_entity"]), a["save"], a)


def test_wandb_writer_on_the_last_rank_with_megatrons_names(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = _wandb_args(tmp_path, wandb_entity="team")
    assert open_wandb(*args, rank=0, world_size=4) is None and open_wandb(*args, rank=2, world_size=4) is None
    assert fake.calls == []
    run = open_wandb(*args, rank=3, world_size=4)
    (kind, kwargs), = fake.calls
    assert kind == "init" and kwargs["dir"] == str(tmp_path / "ck" / "wandb") and (tmp_path / "ck" / "wandb").is_dir()
    assert (kwargs["name"], kwargs["project"], kwargs["entity"], kwargs["config"]["lr"]) == ("run1", "proj", "team", 0.1)
    tb = TensorBoardLogger(str(tmp_path / "tb"), enabled=True, wandb=run)
    tb.scalars({"lm loss": 2.5, "grad-norm": None, "params-norm": 3.0}, iteration=7, consumed_samples=56)
    tb.close()
    assert fake.calls[1:] == [("log", {"lm loss": 2.5, "params-norm": 3.0, "samples vs steps": 56}, 7), ("finish",)]
    open_wandb(*_wandb_args(tmp_path, wandb_save_dir=str(tmp_path / "w")), rank=0, world_size=1)
    assert fake.calls[-1][1]["dir"] == str(tmp_path / "w")


def test_wandb_not_installed_is_one_rank0_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    lines = []
    assert open_wandb(*_wandb_args(tmp_path), rank=0, world_size=2, print_fn=lines.append) is None
    assert open_wandb(*_wandb_args(tmp_path), rank=1, world_size=2, print_fn=lines.append) is None
    assert len(lines) == 1 and "the wandb package is not installed, nothing is sent" in lines[0]
    assert open_wandb(*_wandb_args(tmp_path, wandb_project=None), rank=0, world_size=1, print_fn=lines.append) is None
    assert len(lines) == 1
