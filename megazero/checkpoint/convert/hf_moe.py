"""Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE <-> megazero MoE GPTs (the expert half of :mod:`.hf`).

Attention, norms, embeddings and the dense MLPs map as for Llama (:mod:`.hf`); an MoE layer
``i`` maps as below (``E`` experts ``e``; SwiGLU ``fc1`` rows are ``[gate; up]``, as megazero's):

=====================================  ==================================  ================================
megazero ``layers.i.``                 MixtralForCausalLM                  Qwen2MoeForCausalLM
                                       (``model.layers.i.block_sparse_moe.``)  (``model.layers.i.mlp.``)
=====================================  ==================================  ================================
mlp.router.weight ``[E, h]``           gate.weight                         gate.weight
mlp.experts.e.fc1.weight ``[2f, h]``   cat(experts.e.w1, experts.e.w3)     cat(experts.e.gate_proj, up_proj)
mlp.experts.e.fc2.weight ``[h, f]``    experts.e.w2                        experts.e.down_proj
mlp.shared_expert.fc1 / fc2            --                                  cat(shared_expert.gate_proj, up_proj) / down_proj
mlp.shared_expert_gate.weight          --                                  shared_expert_gate.weight ``[1, h]``
=====================================  ==================================  ================================

Those are the names of the files on the Hub and of ``save_pretrained``. transformers >= 5 holds
the experts in memory as two stacked tensors per layer (``mlp.experts.gate_up_proj`` ``[E, 2f, h]``,
``mlp.experts.down_proj`` ``[E, h, f]``; Mixtral's router under ``mlp.gate``):
:func:`unfuse_experts` / :func:`fuse_experts` convert between the two.

Routing: Mixtral takes the softmax over all ``E`` logits, keeps the top-k and renormalizes them,
which equals the softmax over the top-k logits: Megatron's default (``pre_softmax`` False).
Qwen2-MoE takes the top-k of the full softmax and renormalizes only with ``norm_topk_prob``:
``norm_topk_prob`` False is ``--moe-router-pre-softmax``, True is the default. Qwen2-MoE's layer
``n`` is MoE unless ``n`` is in ``mlp_only_layers`` or ``(n + 1) % decoder_sparse_step != 0``;
the pattern becomes ``--moe-layer-freq`` as a list. Qwen3-MoE (``Qwen3MoeForCausalLM``, 5.24
``models/qwen3_moe``) is Qwen2-MoE's layout and routing (``norm_topk_prob``, default false, the
same two ways; ``decoder_sparse_step`` / ``mlp_only_layers`` the same pattern, the dense layers'
FFN ``intermediate_size``) without the shared expert, under Hub names ``mlp.experts.e.*_proj``
and ``mlp.gate``; its attention has QK-norm (:mod:`.hf_families`). Qwen2-MoE's attention (``qkv_bias``: a bias on
the QKV projection only, ``--add-qkv-bias``; sliding windows refused) is :mod:`.hf_qwen2`'s;
Mixtral's and Qwen3-MoE's sliding windows are :mod:`.hf_families`'. HF configs we cannot express
(Qwen2-MoE's windows, a non-SiLU activation, Qwen2-MoE without its shared expert) are refused
naming the key.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.tensor_parallel.mappings import group_rank, group_size

from megazero.moe.config import MoEConfig

from .hf_families import window_keys

MOE_ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _refuse(arch: str, key: str, value, why: str) -> ValueError:
    return ValueError(f"{MOE_ARCHS[arch]} config {key}={value!r}: {why}")


def _moe(arch: str, **fields) -> MoEConfig:
    try:
        return MoEConfig(**fields)
    except ValueError as e:  # worded in Megatron's flags: name the HF keys too
        keys = "num_local_experts" if arch == "mixtral" else "num_experts"
        raise ValueError(f"{MOE_ARCHS[arch]} config ({keys}, num_experts_per_tok): {e}") from None


def moe_fields(c: dict, arch: str, num_layers: int) -> dict:
    """The :class:`GPTConfig` fields an HF Mixtral / Qwen2-MoE config dict adds to Llama's (the
    ``moe`` block; Mixtral's FFN size), refusing what megazero cannot express."""
    if arch == "mixtral":
        f = c["intermediate_size"]
        moe = _moe(arch, num_experts=c["num_local_experts"], ffn_hidden_size=f, layer_pattern=(1,) * num_layers,
                   router_topk=c.get("num_experts_per_tok", 2), pre_softmax=False)
        return {"ffn_hidden_size": f, "moe": moe}
    E, shared = c.get("num_experts") or c.get("num_local_experts", 0), c.get("shared_expert_intermediate_size")
    if not E:
        raise _refuse(arch, "num_experts", E, "no experts: a dense model, not an MoE one")
    if arch == "qwen3_moe":
        shared = None
    elif not shared:
        raise _refuse(arch, "shared_expert_intermediate_size", shared,
                      "Qwen2-MoE's gated shared expert needs a positive size")
    step, dense = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
    pattern = tuple(0 if n in dense or (n + 1) % step else 1 for n in range(num_layers))
    if not any(pattern):
        raise _refuse(arch, "mlp_only_layers", sorted(dense), f"with decoder_sparse_step {step} no layer is MoE")
    moe = _moe(arch, num_experts=E, ffn_hidden_size=c["moe_intermediate_size"], layer_pattern=pattern,
               router_topk=c.get("num_experts_per_tok", 4), pre_softmax=not c.get("norm_topk_prob", False),
               shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))
    return {"moe": moe}


def moe_layer_map(arch: str, i: int, moe: MoEConfig) -> dict[str, list[tuple[str, bool]]]:
    """megazero MoE layer-``i`` suffix -> [(HF name, transpose)] whose rows are concatenated."""
    if arch == "mixtral":
        p, gate, up, down = f"model.layers.{i}.block_sparse_moe.", "w1", "w3", "w2"
    else:
        p, gate, up, down = f"model.layers.{i}.mlp.", "gate_proj", "up_proj", "down_proj"
    m = {"mlp.router.weight": [(p + "gate.weight", False)]}
    for e in range(moe.num_experts):
        m[f"mlp.experts.{e}.fc1.weight"] = [(p + f"experts.{e}.{gate}.weight", False),
                                            (p + f"experts.{e}.{up}.weight", False)]
        m[f"mlp.experts.{e}.fc2.weight"] = [(p + f"experts.{e}.{down}.weight", False)]
    if moe.shared_expert_intermediate_size:
        m["mlp.shared_expert.fc1.weight"] = [(p + "shared_expert.gate_proj.weight", False),
                                             (p + "shared_expert.up_proj.weight", False)]
        m["mlp.shared_expert.fc2.weight"] = [(p + "shared_expert.down_proj.weight", False)]
    if moe.shared_expert_gate:
        m["mlp.shared_expert_gate.weight"] = [(p + "shared_expert_gate.weight", False)]
    return m


def _expert_names(arch: str, layer_prefix: str, e: int) -> tuple[str, str, str]:
    """Hub names of expert ``e``'s (gate, up, down) under ``model.layers.i.``."""
    if arch == "mixtral":
        return tuple(f"{layer_prefix}block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
    return tuple(f"{layer_prefix}mlp.experts.{e}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))


def unfuse_experts(state: dict, arch: str) -> dict:
    """transformers >= 5's in-memory expert tensors (``mlp.experts.gate_up_proj`` ``[E, 2f, h]``,
    ``mlp.experts.down_proj``; Mixtral's ``mlp.gate``) as the Hub's per-expert names (views);
    other entries unchanged. A state dict already in the Hub layout comes back as it is."""
    out = {}
    for key, t in state.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[:-len("mlp.experts.gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up, _ = _expert_names(arch, prefix, e)
                out[gate], out[up] = t[e].chunk(2, dim=0)
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[:-len("mlp.experts.down_proj")]
            for e in range(t.shape[0]):
                out[_expert_names(arch, prefix, e)[2]] = t[e]
        elif arch == "mixtral" and key.endswith(".mlp.gate.weight"):
            out[key.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
        else:
            out[key] = t
    return out


def fuse_experts(state: dict, arch: str, moe: MoEConfig) -> dict:
    """The inverse of :func:`unfuse_experts`: what ``load_state_dict`` of a transformers >= 5
    model takes."""
    out, taken = {}, set()
    for n in (n for n, on in enumerate(moe.layer_pattern) if on):
        prefix = f"model.layers.{n}."
        names = [_expert_names(arch, prefix, e) for e in range(moe.num_experts)]
        if not all(x in state for triple in names for x in triple):
            continue  # a slice without this layer
        out[prefix + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state[g], state[u]]) for g, u, _ in names])
        out[prefix + "mlp.experts.down_proj"] = torch.stack([state[d] for _, _, d in names])
        taken.update(x for triple in names for x in triple)
    for key, t in state.items():
        if key not in taken:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.") if arch == "mixtral" else key] = t
    return out


def gather_experts(model, full: dict) -> dict:
    """``full`` (this EP rank's :meth:`GPTModel.full_state_dict`) with every EP rank's routed
    experts added: each expert's full weights broadcast from the rank owning it over the EP
    group. A collective over the EP group; nothing to do at EP 1."""
    moe, c = model.config.moe, model.config
    group = model.topo.expert_group("ep") if getattr(model, "topo", None) is not None else None
    EP = group_size(group)
    if moe is None or EP == 1:
        return full
    per, me, out = moe.num_experts // EP, group_rank(group), dict(full)
    f, h = moe.ffn_hidden_size, c.hidden_size
    shapes = {"fc1": ((2 if c.swiglu else 1) * f, h), "fc2": (h, f)}
    for n in sorted(int(k) for k in model.layers.keys()):
        if not moe.is_moe(n):
            continue
        for e in range(moe.num_experts):
            for w, shape in shapes.items():
                name = f"layers.{n}.mlp.experts.{e}.{w}.weight"
                t = full[name] if e // per == me else torch.empty(shape, dtype=c.params_dtype, device=model.device)
                dist.broadcast(t, dist.get_global_rank(group, e // per), group=group)
                out[name] = t
    return out


def moe_arch_of_config(config) -> str:
    """``qwen2_moe`` for an MoE GPT with a shared expert, else ``qwen3_moe`` with QK-norm, else
    ``mixtral``."""
    if config.moe.shared_expert_intermediate_size:
        return "qwen2_moe"
    return "qwen3_moe" if config.qk_layernorm else "mixtral"


def hf_moe_config(config, arch: str, llama: dict) -> dict:
    """The HF ``config.json`` of an MoE :class:`GPTConfig` from its Llama-style part ``llama``,
    refusing what the HF architecture cannot express. Training-only settings (aux losses,
    capacity and dropping, router dtype, dispatcher) are not part of the HF model."""
    c, moe = config, config.moe
    bad = [m for m, ok in (("softmax router scores", moe.score_function == "softmax"),
                           ("no top-k scaling factor", moe.topk_scaling_factor in (None, 1.0)),
                           ("no group-limited routing", moe.num_groups is None),
                           ("no expert bias", not moe.enable_expert_bias),
                           ("no linear biases", not c.add_bias_linear)) if not ok]
    if arch == "mixtral":
        bad += [m for m, ok in (("every layer MoE (--moe-layer-freq 1)", all(moe.layer_pattern)),
                                ("no shared expert", not moe.shared_expert_intermediate_size),
                                ("top-k renormalized (no --moe-router-pre-softmax)", not moe.pre_softmax)) if not ok]
    elif arch == "qwen3_moe":
        bad += [m for m, ok in (("no shared expert", not moe.shared_expert_intermediate_size),
                                ("no QKV bias", not c.qkv_bias)) if not ok]
    else:
        bad += [m for m, ok in (("a gated shared expert", bool(moe.shared_expert_intermediate_size
                                                               and moe.shared_expert_gate)),) if not ok]
    if bad:
        raise ValueError(f"{MOE_ARCHS[arch]} export needs: {', '.join(bad)}")
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(architectures=[MOE_ARCHS[arch]], model_type=arch, num_experts_per_tok=moe.router_topk,
               output_router_logits=False)
    if arch == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size,
                   router_jitter_noise=0.0, **window_keys(c, arch))
        return out
    dense = [n for n, on in enumerate(moe.layer_pattern) if not on]
    if arch == "qwen3_moe":
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size, attention_bias=False,
                   norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1, mlp_only_layers=dense,
                   **window_keys(c, arch))
        return out
    out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
               shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
               norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1, qkv_bias=c.qkv_bias,
               mlp_only_layers=[n for n, on in enumerate(moe.layer_pattern) if not on],
               use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    return out
