"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> megazero: multi-latent attention, the
sigmoid group-limited router with its correction bias, shared experts, the first
``first_k_dense_replace`` layers dense, and the multi-token-prediction layers.

What transformers 5.24.0 computes (``models/deepseek_v3/modeling_deepseek_v3.py``) and what it is
here (the flags are Megatron-LM's):

=====================================  =================================================================
HF config                              megazero
=====================================  =================================================================
q_lora_rank, kv_lora_rank,             ``--multi-latent-attention --q-lora-rank --kv-lora-rank
qk_nope_head_dim, qk_rope_head_dim,    --qk-head-dim --qk-pos-emb-head-dim --v-head-dim``
v_head_dim                             (:mod:`megazero.model.mla`)
rope_parameters (default / yarn:       ``--rope-type rope`` / ``yarn`` with ``--rotary-scaling-factor``,
factor, mscale, mscale_all_dim, ...)   ``--mscale``, ``--mscale-all-dim`` and YaRN's three fields
n_routed_experts, num_experts_per_tok  ``--num-experts``, ``--moe-router-topk``, sigmoid scores, the
n_group, topk_group                    expert bias, ``--moe-router-num-groups/-group-topk``
routed_scaling_factor                  ``--moe-router-topk-scaling-factor``
n_shared_experts x moe_intermediate    ``--moe-shared-expert-intermediate-size`` (no gate)
first_k_dense_replace                  ``--moe-layer-freq [0]*k + [1]*(L-k)``
num_nextn_predict_layers (D)           ``--mtp-num-layers D`` (:mod:`megazero.model.mtp`)
=====================================  =================================================================

Weights of layer ``i`` (``model.layers.i.``): ``input_layernorm`` / ``post_attention_layernorm`` ->
``input_norm`` / ``post_attention_norm``; ``self_attn.`` ``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``
-> ``attention.`` ``q_down``, ``q_norm``, ``q_up`` (``q_proj``), ``kv_down``, ``kv_norm``,
``kv_up``, ``dense`` (same row layouts); a dense MLP as Llama's; an MoE one: ``mlp.gate.weight`` ->
``mlp.router.weight``, ``mlp.gate.e_score_correction_bias`` -> the buffer
``mlp.router.expert_bias``, ``mlp.experts.e.{gate,up,down}_proj`` -> ``mlp.experts.e.fc1``
(``[gate; up]``) / ``fc2``, ``mlp.shared_experts.*`` -> ``mlp.shared_expert.fc1/fc2``. MTP depth
``k`` is ``model.layers.{L+k}.`` (DeepSeek's released layout, which transformers' ``MtpModel``
reads): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` -> ``mtp.layers.k.enorm``,
``hnorm``, ``eh_proj``, ``final_norm``; the layer's own weights -> ``mtp.layers.k.transformer_layer.``;
``embed_tokens`` and ``shared_head.head`` are copies of the shared embedding and head (written on
export, not read).

Refused, naming the field and value: ``hidden_act`` other than silu, ``attention_bias``,
``rope_interleave`` false, ``num_key_value_heads`` != heads, ``scoring_func`` other than sigmoid,
``topk_method`` other than noaux_tc, ``norm_topk_prob`` false (with top-k > 1; true with top-1)
-- Megatron normalizes sigmoid weights exactly when top-k > 1 --, ``num_experts_per_tok /
topk_group`` != 2 with more than one group (transformers scores a group by its top-2 scores,
Megatron by its top ``k / topk_group``: docs/moe.md), another RoPE scaling, MTP layers after a
dense last layer (transformers' MTP layers are always MoE, megazero's follow the last layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.model.config import replace_config
from megazero.moe.config import MoEConfig
from megazero.tensor_parallel.mappings import group_rank, group_size

DEEPSEEK_ARCHS = {"deepseek_v3": "DeepseekV3ForCausalLM"}
_ATTN = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "q_proj": "q_proj",
         "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "dense": "o_proj"}
_YARN = {"factor": "rotary_scaling_factor", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
         "original_max_position_embeddings": "original_max_position_embeddings", "beta_fast": "beta_fast",
         "beta_slow": "beta_slow"}


def _refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"DeepseekV3ForCausalLM config {key}={value!r}: {why}")


def _check(c: dict) -> None:
    k, group_topk, groups = c.get("num_experts_per_tok", 8), c.get("topk_group"), c.get("n_group")
    for key, default, ok, why in (
            ("hidden_act", "silu", lambda v: v == "silu", "megazero's SwiGLU needs silu"),
            ("attention_bias", False, lambda v: not v, "MLA's projections have no biases in megazero (as Megatron's)"),
            ("rope_interleave", True, bool, "megazero's MLA applies RoPE to DeepSeek's interleaved pairs"),
            ("num_key_value_heads", c["num_attention_heads"], lambda v: v in (None, c["num_attention_heads"]),
             "MLA has one key and value per head (num_key_value_heads = num_attention_heads)"),
            ("scoring_func", "sigmoid", lambda v: v == "sigmoid", "DeepSeek-V3's router is sigmoid"),
            ("topk_method", "noaux_tc", lambda v: v == "noaux_tc", "the expert-bias top-k (noaux_tc) is what converts"),
            ("norm_topk_prob", True, lambda v: bool(v) == (k > 1),
             f"Megatron normalizes the sigmoid top-{k} weights exactly when top-k > 1"),
            ("pretraining_tp", 1, lambda v: v in (None, 1), "only 1 is the trained function")):
        if not ok(c.get(key, default)):
            raise _refuse(key, c.get(key, default), why)
    if groups not in (None, 1) and group_topk and group_topk < groups and k != 2 * group_topk:
        raise _refuse("topk_group", group_topk, f"num_experts_per_tok {k} / topk_group must be 2: transformers "
                      "scores a group by its top-2 scores, Megatron (and megazero) by its top num_experts_per_tok / "
                      "topk_group (equal only at 2, as in DeepSeek-V3)")


def _rope_fields(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rotary_base": theta, "rope_type": "rope"}
    if kind != "yarn":
        raise _refuse("rope_parameters", rope, "only default RoPE and YaRN (DeepSeek's) convert")
    if rope.get("attention_factor") is not None:
        raise _refuse("rope_parameters.attention_factor", rope["attention_factor"], "megazero derives YaRN's "
                      "concentration factor from factor, mscale and mscale_all_dim (Megatron's rule)")
    m, m_all, factor = rope.get("mscale"), rope.get("mscale_all_dim"), rope.get("factor") or 1.0
    if factor > 1 and not (m and m_all) and (m if m is not None else 1.0) != 1.0:
        # transformers (modeling_rope_utils._compute_yarn_parameters) then uses mscale 1 in the cos/sin
        # concentration; Megatron's (and megazero's) ratio uses the given mscale: another model
        raise _refuse("rope_parameters.mscale", m, f"with mscale_all_dim {m_all} transformers' YaRN ignores it and "
                      "megazero's (Megatron's) does not; give both mscale and mscale_all_dim, or mscale 1")
    out = {"rotary_base": theta, "rope_type": "yarn"}
    out.update({ours: rope[hf] for hf, ours in _YARN.items() if rope.get(hf) is not None})
    return out


def deepseek_fields(c: dict) -> dict:
    """Every :class:`GPTConfig` field of an HF ``DeepseekV3Config`` dict (see the module doc)."""
    _check(c)
    L, heads = c["num_hidden_layers"], c["num_attention_heads"]
    dense = min(c.get("first_k_dense_replace", 3) or 0, L)
    pattern = (0,) * dense + (1,) * (L - dense)
    D = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or None
    if D and not pattern[-1]:
        raise _refuse("first_k_dense_replace", dense, f"with all {L} layers dense the {D} MTP layer(s) would be dense "
                      "here and MoE in transformers")
    groups = c.get("n_group")  # keeping every group (n_group 1, or topk_group = n_group) is no group limit
    groups = groups if groups not in (None, 1) and (c.get("topk_group") or groups) < groups else None
    shared = (c.get("n_shared_experts") or 0) * c["moe_intermediate_size"] or None
    try:
        moe = MoEConfig(num_experts=c["n_routed_experts"], ffn_hidden_size=c["moe_intermediate_size"],
                        layer_pattern=pattern, router_topk=c.get("num_experts_per_tok", 8), score_function="sigmoid",
                        topk_scaling_factor=c.get("routed_scaling_factor", 1.0), num_groups=groups,
                        group_topk=c.get("topk_group") if groups else None, router_dtype="fp32",
                        enable_expert_bias=True, shared_expert_intermediate_size=shared)
    except ValueError as e:
        raise ValueError(f"DeepseekV3ForCausalLM config (n_routed_experts, num_experts_per_tok, n_group, "
                         f"topk_group): {e}") from None
    seq = c.get("max_position_embeddings", 4096)
    return dict(num_layers=L, hidden_size=c["hidden_size"], num_attention_heads=heads, num_query_groups=heads,
                vocab_size=c["vocab_size"], ffn_hidden_size=c["intermediate_size"], seq_length=seq,
                max_position_embeddings=seq, position_embedding_type="rope", normalization="RMSNorm",
                norm_epsilon=c.get("rms_norm_eps", 1e-6), activation="swiglu", add_bias_linear=False,
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                attention_dropout=c.get("attention_dropout", 0.0), hidden_dropout=0.0,
                init_method_std=c.get("initializer_range", 0.02), multi_latent_attention=True, qk_layernorm=True,
                q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"],
                qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], moe=moe, mtp_num_layers=D,
                **_rope_fields(c))


def _layer(p: str, moe, n: int, E: int) -> dict[str, list[tuple[str, bool]]]:
    """megazero layer suffix -> [(HF name, transpose)] under HF prefix ``p`` (global layer ``n``)."""
    m = {"input_norm.weight": [(p + "input_layernorm.weight", False)],
         "post_attention_norm.weight": [(p + "post_attention_layernorm.weight", False)]}
    m.update({f"attention.{ours}.weight": [(p + f"self_attn.{hf}.weight", False)] for ours, hf in _ATTN.items()})
    if not moe.is_moe(n):
        m["mlp.fc1.weight"] = [(p + "mlp.gate_proj.weight", False), (p + "mlp.up_proj.weight", False)]
        m["mlp.fc2.weight"] = [(p + "mlp.down_proj.weight", False)]
        return m
    m["mlp.router.weight"] = [(p + "mlp.gate.weight", False)]
    m["mlp.router.expert_bias"] = [(p + "mlp.gate.e_score_correction_bias", False)]
    for e in range(E):
        m[f"mlp.experts.{e}.fc1.weight"] = [(p + f"mlp.experts.{e}.gate_proj.weight", False),
                                            (p + f"mlp.experts.{e}.up_proj.weight", False)]
        m[f"mlp.experts.{e}.fc2.weight"] = [(p + f"mlp.experts.{e}.down_proj.weight", False)]
    if moe.shared_expert_intermediate_size:
        m["mlp.shared_expert.fc1.weight"] = [(p + "mlp.shared_experts.gate_proj.weight", False),
                                             (p + "mlp.shared_experts.up_proj.weight", False)]
        m["mlp.shared_expert.fc2.weight"] = [(p + "mlp.shared_experts.down_proj.weight", False)]
    return m


def deepseek_name_map(config) -> dict[str, list[tuple[str, bool]]]:
    """megazero name -> [(HF name, transpose)] of a DeepSeek-V3 :class:`GPTConfig` (the expert
    bias buffers and the MTP layers included)."""
    moe, L = config.moe, config.num_layers
    m = {"embedding.word_embeddings.weight": [("model.embed_tokens.weight", False)],
         "final_norm.weight": [("model.norm.weight", False)], "output_layer.weight": [("lm_head.weight", False)]}
    for i in range(L):
        m.update({f"layers.{i}.{k}": v for k, v in _layer(f"model.layers.{i}.", moe, i, moe.num_experts).items()})
    for k in range(config.mtp_num_layers or 0):
        p, ours = f"model.layers.{L + k}.", f"mtp.layers.{k}."
        m.update({ours + "transformer_layer." + s: v for s, v in _layer(p, moe, L + k, moe.num_experts).items()})
        for name, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                         ("final_norm", "shared_head.norm")):
            m[f"{ours}{name}.weight"] = [(f"{p}{hf}.weight", False)]
    return m


def mtp_copies(full_state: dict, config) -> dict:
    """The HF copies DeepSeek's MTP layers carry (``model.layers.{L+k}.embed_tokens`` and
    ``shared_head.head``), from ``full_state``'s embedding and head (what it holds of them)."""
    out, L = {}, config.num_layers
    head = full_state.get("embedding.word_embeddings.weight" if config.tied_embeddings else "output_layer.weight")
    for k in range(config.mtp_num_layers or 0):
        if "embedding.word_embeddings.weight" in full_state:
            out[f"model.layers.{L + k}.embed_tokens.weight"] = full_state["embedding.word_embeddings.weight"]
        if head is not None:
            out[f"model.layers.{L + k}.shared_head.head.weight"] = head
    return out


def deepseek_hf_config(config, llama: dict) -> dict:
    """The ``DeepseekV3ForCausalLM`` ``config.json`` of a :class:`GPTConfig` (from its Llama-style part
    ``llama``), refusing what DeepSeek-V3 cannot express."""
    c, moe = config, config.moe
    bad = [m for m, ok in (("--multi-latent-attention", c.multi_latent_attention), ("an MoE model", moe is not None),
                           ("sigmoid router scores", moe is not None and moe.score_function == "sigmoid"),
                           ("--moe-router-enable-expert-bias", moe is not None and moe.enable_expert_bias),
                           ("no shared-expert gate", moe is not None and not moe.shared_expert_gate),
                           ("a dense prefix then MoE layers (--moe-layer-freq [0]*k+[1]*(L-k))",
                            moe is not None and list(moe.layer_pattern) == sorted(moe.layer_pattern)),
                           ("top-k / group-topk = 2", moe is None or not moe.group_topk
                            or moe.router_topk == 2 * moe.group_topk)) if not ok]
    if bad:
        raise ValueError(f"DeepseekV3ForCausalLM export needs: {', '.join(bad)}")
    shared = moe.shared_expert_intermediate_size or 0
    if shared % moe.ffn_hidden_size:
        raise ValueError(f"DeepseekV3ForCausalLM export needs --moe-shared-expert-intermediate-size {shared} a "
                         f"multiple of --moe-ffn-hidden-size {moe.ffn_hidden_size} (n_shared_experts)")
    rope = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
    if c.rope_type in (None, "yarn"):
        rope = {"rope_type": "yarn", "rope_theta": float(c.rotary_base),
                **{hf: getattr(c, ours) for hf, ours in _YARN.items()}}
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias", "head_dim", "rope_theta")}
    out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=c.num_attention_heads,
               q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
               qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim, rope_parameters=rope,
               rope_interleave=True, attention_bias=False, n_routed_experts=moe.num_experts,
               moe_intermediate_size=moe.ffn_hidden_size, n_shared_experts=shared // moe.ffn_hidden_size,
               num_experts_per_tok=moe.router_topk, n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1,
               routed_scaling_factor=moe.topk_scaling_factor or 1.0, norm_topk_prob=moe.router_topk > 1,
               first_k_dense_replace=moe.layer_pattern.index(1), num_nextn_predict_layers=c.mtp_num_layers or 0)
    return out


# ---- the converter tool's pieces (tools/convert_checkpoint.py) ---------------------------------------
def mla_mtp_flags(config) -> list[str]:
    """Megatron's MLA flags that differ from its defaults, and the MTP flags, of ``config``."""
    from megazero.model.mla_config import MLA_DEFAULTS, mla_to_args
    out = []
    if config.multi_latent_attention:
        out += [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v:g}" if isinstance(v, float) else f" {v}")
                for k, v in mla_to_args(config).items() if v != MLA_DEFAULTS[k] and v is not None]
    if config.mtp_num_layers:
        out.append(f"--mtp-num-layers {config.mtp_num_layers} "
                   f"--mtp-loss-scaling-factor {config.mtp_loss_scaling_factor:g}")
    return out


def without_missing_mtp(config, have, config_path: str):
    """``config`` without MTP when the folder (its tensor names ``have``) holds no MTP weights though
    the config counts some (transformers' ``save_pretrained`` writes none), saying so."""
    if config.mtp_num_layers and f"model.layers.{config.num_layers}.eh_proj.weight" not in have:
        print(f"note: {config_path} has num_nextn_predict_layers {config.mtp_num_layers} but the folder no MTP "
              "weights (transformers' DeepseekV3ForCausalLM saves none): imported without MTP")
        return replace_config(config, mtp_num_layers=None)
    return config


def saved_buffers(reader, arch: str, config) -> list[str]:
    """The persistent buffers an HF export writes (the routers' expert bias) that ``reader`` holds."""
    if arch not in DEEPSEEK_ARCHS:
        return []
    return [n for n in deepseek_name_map(config) if n.endswith("expert_bias") and reader.has_buffer(n)]


def gather_mtp_experts(model, full: dict) -> dict:
    """``full`` with every EP rank's routed experts of the MTP layers added (each broadcast from its
    owner over the EP group, as :func:`~megazero.checkpoint.convert.hf_moe.gather_experts` does for
    the decoder's); nothing to do at EP 1 or without MTP layers on this slice."""
    c, moe = model.config, model.config.moe
    group = model.topo.expert_group("ep") if getattr(model, "topo", None) is not None else None
    if moe is None or getattr(model, "mtp", None) is None or group_size(group) == 1:
        return full
    per, me, out = moe.num_experts // group_size(group), group_rank(group), dict(full)
    shapes = {"fc1": ((2 if c.swiglu else 1) * moe.ffn_hidden_size, c.hidden_size),
              "fc2": (c.hidden_size, moe.ffn_hidden_size)}
    for k in range(c.mtp_num_layers):
        if not moe.is_moe(c.num_layers + k):
            continue
        for e in range(moe.num_experts):
            for w, shape in shapes.items():
                name = f"mtp.layers.{k}.transformer_layer.mlp.experts.{e}.{w}.weight"
                t = full[name] if e // per == me else torch.empty(shape, dtype=c.params_dtype, device=model.device)
                dist.broadcast(t, dist.get_global_rank(group, e // per), group=group)
                out[name] = t
    return out
