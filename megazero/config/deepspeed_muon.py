"""A DeepSpeed config's ``"optimizer": {"type": "Muon", "params": {...}}``, as DeepSpeed 0.19.8 reads it
(``runtime/engine.py: _configure_basic_optimizer`` / ``_muon_param_groups``,
``runtime/zero/muon/original_muon.py: MuonWithAuxAdam``, ``deepspeed/__init__.py:
set_optimizer_flags``).

Which parameters: ``use_muon`` is set by ``deepspeed.initialize`` on every parameter of at least
2 dimensions whose name contains neither ``embed`` nor ``lm_head`` (lower-cased); the rest step
with Adam. Each of the user's param groups is split in a Muon half and an Adam half; a half's
settings are, most specific last: the block's shared ``lr`` / ``weight_decay`` (plus ``momentum``,
``ns_method`` for Muon; ``betas``, ``eps`` for Adam), then ``muon_lr`` / ``adam_lr``, then the
group's own keys; what is still missing takes MuonWithAuxAdam's defaults: Muon lr 0.02,
momentum 0.95, weight_decay 0, ns_method ``gram``; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10,
weight_decay 0. ``adam_w_mode`` (default true): decoupled decay of the Adam half. Muon's update:
Nesterov always, scale sqrt(max(1, rows/cols)), Newton-Schulz ``standard`` (bf16) or ``gram``
(fp16 where the accelerator has it, else fp32: DeepSpeed's ``ns_compute_dtype``).

Refused, one line each: ``per_head_muon: true`` (not implemented); ``fp16`` (DeepSpeed's ZeRO
Muon carries no loss scale in its update); ``gradient_clipping`` > 0 at ZeRO >= 1 (DeepSpeed's
ZeRO 1-3 orthogonalize before clipping, so the norm it clips is the update's, unlike its stage 0
and torch: megazero would clip something else); an optimizer-state offload.
``pretrain_gpt.py --deepspeed-config`` steps both halves with one lr and weight decay (Megatron's
trainer): there the halves' lr and weight_decay must agree.
"""

from __future__ import annotations

import torch

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
READ = {"lr", "momentum", "weight_decay", "ns_method", "betas", "eps", "muon_lr", "adam_lr", "adam_w_mode",
        "per_head_muon", "torch_adam"}


def halves(params: dict) -> dict:
    """``{"muon": {...}, "adam": {...}}``: the config-level settings of each half (module docstring),
    before the user's groups' own keys."""
    muon = dict(MUON_DEFAULTS, **{k: params[k] for k in MUON_DEFAULTS if k in params})
    adam = dict(ADAM_DEFAULTS, **{k: params[k] for k in ADAM_DEFAULTS if k in params})
    if "muon_lr" in params:
        muon["lr"] = params["muon_lr"]
    if "adam_lr" in params:
        adam["lr"] = params["adam_lr"]
    adam["betas"] = tuple(adam["betas"])
    return {"muon": muon, "adam": adam}


def apply_muon(m, params: dict) -> None:
    """Resolve a Muon block: ``args.muon_settings`` (MuonSettings' fields), ``args.muon_halves``
    and the trainer's flags (``--lr``, ``--weight-decay``, ``--adam-*`` from the Adam half)."""
    args = m.args
    for name, value in params.items():
        if name not in READ:
            m.notes["unknown, not read"].append(f"optimizer.params.{name}")
        elif value == "auto":
            m.fail(f"key 'optimizer.params.{name}' = \"auto\" is not available for Muon; write the value")
    if m.typed("optimizer.params.per_head_muon", params.get("per_head_muon", False), bool):
        m.fail("key 'optimizer.params.per_head_muon' = true is not available in megazero; drop it (full-matrix Muon)")
    for key in ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps"):
        if key in params:
            m.typed(f"optimizer.params.{key}", params[key], float)
    h = halves(params)
    if h["muon"]["ns_method"] not in ("gram", "standard"):
        m.fail(f"key 'optimizer.params.ns_method' must be 'gram' or 'standard', got {h['muon']['ns_method']!r}")
    if not 0.0 <= float(h["muon"]["momentum"]) < 1.0:
        m.fail(f"key 'optimizer.params.momentum' must be in [0, 1), got {h['muon']['momentum']}")
    mode = m.typed("optimizer.params.adam_w_mode", params.get("adam_w_mode", True), bool)
    gram = h["muon"]["ns_method"] == "gram"
    args.muon_settings = dict(momentum=float(h["muon"]["momentum"]), nesterov=True, ns_steps=5,
                              coefficient_type="simple", flavour="deepspeed_gram" if gram else "deepspeed",
                              ns_dtype=None if gram else torch.bfloat16, scale_mode="original", split_qkv=False,
                              decoupled=True)
    args.muon_halves, args.adam_w_mode, args.optimizer = h, mode, "muon"
    values = dict(lr=float(h["adam"]["lr"]), weight_decay=float(h["adam"]["weight_decay"]),
                  adam_beta1=float(h["adam"]["betas"][0]), adam_beta2=float(h["adam"]["betas"][1]),
                  adam_eps=float(h["adam"]["eps"]))
    for dest, value in values.items():  # an explicit flag wins, as for Adam's block
        if dest not in m.explicit:
            setattr(args, dest, value)
    m.record("config", "optimizer.type", "Muon")


def check_muon_config(fail, args) -> None:
    """The Muon block's refusals that depend on the rest of the config (module docstring)."""
    h = getattr(args, "muon_halves", None)
    if h is None:
        return
    if getattr(args, "fp16", False):
        fail("--deepspeed-config: optimizer Muon with fp16 is not available; use bf16 or fp32")
    if args.clip_grad and args.zero_stage >= 1:
        fail("--deepspeed-config: optimizer Muon with gradient_clipping at ZeRO >= 1 is not available (DeepSpeed's "
             "ZeRO clips the orthogonalized update there, torch and its stage 0 the gradient); set it to 0")


def check_muon_trainer(fail, args) -> None:
    """``pretrain_gpt.py``: one lr and weight decay for both halves (Megatron's trainer)."""
    h = getattr(args, "muon_halves", None)
    if h is not None and (h["muon"]["lr"] != h["adam"]["lr"] or h["muon"]["weight_decay"] != h["adam"]["weight_decay"]):
        fail("--deepspeed-config: optimizer Muon's two halves have different lr or weight_decay (muon_lr/adam_lr or "
             "DeepSpeed's defaults 0.02 / 3e-4); pretrain_gpt.py steps both with --lr: give optimizer.params.lr "
             "and weight_decay")
