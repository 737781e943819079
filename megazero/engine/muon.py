"""``megazero.initialize`` with a DeepSpeed ``"optimizer": {"type": "Muon"}`` block: DeepSpeed 0.19.8's
parameter split and param groups (``deepspeed/__init__.py: set_optimizer_flags``,
``runtime/engine.py: _muon_param_groups``; the settings: :mod:`megazero.config.deepspeed_muon`).

``use_muon``: at least 2 dimensions and a (lower-cased) name without ``embed`` or ``lm_head``.
Each user group becomes a Muon half (``lr``, ``momentum``, ``weight_decay``, ``ns_method``) and an
Adam half (``lr``, ``betas``, ``eps``, ``weight_decay``): the config's values, then the group's own
keys of that half. The Muon matrices are stepped by ZeRO's owner ranks
(:mod:`megazero.zero.muon_shards`), the Adam half as every engine group.
"""

from __future__ import annotations

from megazero.optim.muon import MuonSettings
from megazero.zero.muon_shards import MuonMatrix


def muon_groups(module, groups: list[dict], halves: dict) -> list[dict]:
    """The user's groups split in DeepSpeed's Muon and Adam halves (module docstring)."""
    name_of = {id(p): n.lower() for n, p in module.named_parameters()}

    def use_muon(p) -> bool:
        name = name_of[id(p)]
        return p.dim() >= 2 and "embed" not in name and "lm_head" not in name
    out = []
    for g in groups:
        overrides = {k: v for k, v in g.items() if k != "params"}
        for flag, defaults in ((True, halves["muon"]), (False, halves["adam"])):
            half = [p for p in g["params"] if use_muon(p) is flag]
            if not half:
                continue
            settings = dict(defaults)
            settings.update({k: v for k, v in overrides.items() if k in defaults})
            out.append(dict(params=half, use_muon=flag, **settings))
    for g in out:
        bad = next((name_of[id(p)] for p in g["params"] if g["use_muon"] and p.dim() > 2), None)
        if bad is not None:
            raise ValueError(f"megazero.initialize: Muon parameter {bad!r} has more than 2 dimensions; megazero's "
                             "Muon takes matrices (name it with 'embed' to step it with Adam)")
        if g["use_muon"] and (g["momentum"], g["ns_method"]) != (halves["muon"]["momentum"],
                                                                halves["muon"]["ns_method"]):
            raise ValueError("megazero.initialize: a param group sets its own Muon momentum or ns_method; "
                             "set them in the config's optimizer.params")
    return out


def muon_setup(module, groups: list[dict], muon: dict):
    """``(groups, MuonSettings, {param: MuonMatrix})`` for ``ZeroOptimizer.set_muon``."""
    split = muon_groups(module, groups, muon["halves"])
    matrices = {p: MuonMatrix() for g in split if g["use_muon"] for p in g["params"]}
    return split, MuonSettings(**muon["settings"]), matrices
