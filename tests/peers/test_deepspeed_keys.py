"""The ZeRO and optimizer keys of a ds_config, checked against the installed DeepSpeed's own config
classes (0.19.8: ``deepspeed/runtime/zero/config.py`` ``DeepSpeedZeroConfig``, a pydantic model with
``extra="forbid"`` and ``populate_by_name``): every key it accepts -- field name or alias -- at its
default is accepted by megazero (honoured, or listed once as having no effect), and a key it
refuses megazero refuses. Optimizer params: what ``engine._configure_basic_optimizer`` passes to
torch.optim.AdamW (``torch_adam``) or pops itself."""

import inspect
import json
import warnings

import pytest
import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from megazero.arguments import parse_args

SHAPE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"]
DEFAULTS = DeepSpeedZeroConfig().model_dump(mode="json")  # field name -> default, as JSON
KEYS = sorted({(name, alias) for name, field in DeepSpeedZeroConfig.model_fields.items()
               for alias in {name, field.alias or name}})


def megazero(tmp_path, config, extra=("--lr", "1")):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **config}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(["--deepspeed-config", str(path), *SHAPE, *extra], world_size=2, prog="pretrain_gpt.py")
    return args, " ".join(str(w.message) for w in caught)


@pytest.mark.parametrize("name,key", KEYS)
def test_every_zero_key_deepspeed_accepts(tmp_path, name, key):
    value = DEFAULTS[name]
    DeepSpeedZeroConfig(**{key: value})  # DeepSpeed accepts it ...
    args, notes = megazero(tmp_path, {"zero_optimization": {key: value}})  # ... and so does megazero
    mine = {"stage": args.zero_stage, "reduce_bucket_size": args.zero_reduce_bucket_size,
            "overlap_comm": args.zero_overlap_comm, "prefetch_bucket_size": args.zero_prefetch_bucket_size,
            "param_persistence_threshold": args.zero_param_persistence_threshold,
            "max_live_parameters": args.zero_max_live_parameters,
            "max_reuse_distance": args.zero_max_reuse_distance,
            "compute_grad_norm": True}  # megazero always computes the norm (false: see docs/zero.md)
    if name in mine:  # honoured: megazero's value is DeepSpeed's
        assert mine[name] == (value if value is not None else args.zero_stage == 3)
    elif value not in (None, {}, []) or key in ("offload_optimizer", "offload_param"):
        assert key in notes  # one line naming it (or its stage3_ alias) as not read


@pytest.mark.parametrize("key,value", [("stage3_prefetch", 1), ("reduce_bucket_size", 0), ("stage", "three"),
                                       ("overlap_comm", "maybe"), ("max_live_parameters", -1)])
def test_zero_values_deepspeed_refuses(tmp_path, capsys, key, value):
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        DeepSpeedZeroConfig(**{key: value})
    with pytest.raises(SystemExit):
        megazero(tmp_path, {"zero_optimization": {key: value}})
    assert key in capsys.readouterr().err


def test_optimizer_params_deepspeed_passes_on(tmp_path):
    torch_params = set(inspect.signature(torch.optim.AdamW).parameters) - {"params"}
    popped = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # engine.get_optimizer_configuration
    defaults = {k: v.default for k, v in inspect.signature(torch.optim.AdamW).parameters.items() if k != "params"}
    defaults.update(torch_adam=True, adam_w_mode=True, fp32_optimizer_states=True, lr=1e-3, betas=[0.9, 0.999])
    for key in sorted(torch_params | popped):
        args, notes = megazero(tmp_path, {"optimizer": {"type": "AdamW", "params": {key: defaults[key]}}}, ())
        assert args.adam_w_mode and args.lr == 1e-3, key
    args, _ = megazero(tmp_path, {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, ())
    assert args.weight_decay == defaults["weight_decay"]  # torch.optim.AdamW's own default
