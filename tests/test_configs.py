"""The typed configs: built once from the flags, frozen, one docstring per field, Megatron's flag
table a data file."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config import configs
from megazero.config.megatron_flags import megatron_flags, read_table
from megazero.training.build import build_configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "100",
        "--train-iters", "10", "--lr", "1e-3"]


def test_every_config_field_has_a_docstring():
    """torchtitan / Megatron-core style: a string right after each field, naming its flag."""
    tree = ast.parse((ROOT / "megazero" / "config" / "configs.py").read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                              and isinstance(nxt.value.value, str) and nxt.value.value.strip())
                if not documented:
                    missing.append(f"{cls.name}.{node.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


def test_configs_hold_the_flags_and_are_frozen():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel", "--bf16",
                              "--zero-stage", "2", "--save", "/tmp/never-written", "--save-interval", "5",
                              "--no-save-optim", "--log-interval", "3", "--decoupled-lr", "2e-3",
                              "--eod-mask-loss", "--lr-warmup-iters", "2"], world_size=8)
    c = build_configs(args)
    assert (c.parallel.tp, c.parallel.pp, c.parallel.vp, c.parallel.dp, c.parallel.cp, c.parallel.ep) == (2, 2, 2, 2, 1, 1)
    assert c.parallel.sequence_parallel and c.model.sequence_parallel and c.model.params_dtype == torch.bfloat16
    assert (c.optimizer.stage, c.optimizer.params_dtype, c.optimizer.accumulate_in_fp32) == (2, torch.bfloat16, True)
    assert (c.schedule.train_iters, c.schedule.global_batch_size, c.schedule.num_micro_batches) == (10, 16, 4)
    assert c.schedule.batches.num_micro_batches(0) == 4 and not c.schedule.batches.varies
    assert (c.schedule.lr.lr, c.schedule.lr.decoupled_lr, c.schedule.lr.warmup_samples) == (1e-3, 2e-3, 32)
    assert c.schedule.lr.decay_samples == 160  # --lr-decay-iters defaults to --train-iters, x B
    assert (c.checkpoint.save, c.checkpoint.save_interval, c.checkpoint.save_optim) == ("/tmp/never-written", 5, False)
    assert c.logging.log_interval == 3 and c.data.eod_mask_loss and c.data.mock and c.data.vocab_size == 100
    assert c.data.num_workers == 2  # Megatron's --num-workers default, one value for the whole run
    assert c.flags["tensor_model_parallel_size"] == 2 and c.flags["params_dtype"] == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.schedule.train_iters = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.parallel = None
    with pytest.raises(TypeError):
        c.flags["lr"] = 1.0  # a read-only mapping


def test_deepspeed_scheduler_block_reaches_the_lr_config(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLR", '
                  '"params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 5}}}')
    c = build_configs(parse_args(BASE[:-2] + ["--deepspeed-config", str(ds)], world_size=8))
    assert c.schedule.lr.deepspeed_scheduler["warmup_num_steps"] == 5
    assert isinstance(c.schedule.lr, configs.LRConfig)


def test_the_flag_table_is_a_data_file_read_once(tmp_path):
    rows = megatron_flags()
    assert rows is megatron_flags() and len(rows) > 600  # one tuple, read at import
    names = {o for f in rows for o in f.options}
    assert {"--context-parallel-size", "--expert-model-parallel-size", "--tensor-model-parallel-size"} <= names
    bad = tmp_path / "flags.tsv"
    bad.write_text("# header\n--ok\tok\t0\tFalse\t2\tnote\n--broken\tbroken\t0\n")
    with pytest.raises(ValueError, match=r"flags.tsv:3: expected 6 tab-separated cells, found 3"):
        read_table(bad)
