"""Hugging Face GPT-2 / Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen2-MoE / Qwen3-MoE weights <->
megazero, at any TP (and EP) size (``transformers`` not needed).

Conversion goes through the model's *full* state dict (:meth:`GPTModel.full_state_dict`): full,
unpadded tensors keyed by megazero names, which :meth:`GPTModel.load_full_state_dict` slices for
TP. Mapping for layer ``i`` (HF GPT-2's ``Conv1D`` weights are ``[in, out]`` and are transposed;
rows of the fused matrices are concatenated in the order shown):

=================================  ===========================================  ==============================
megazero                           GPT2LMHeadModel (``transformer.``)            LlamaForCausalLM (``model.``)
=================================  ===========================================  ==============================
embedding.word_embeddings.weight   wte.weight                                   embed_tokens.weight
embedding.position_embeddings      wpe.weight                                   (RoPE, none)
layers.i.input_norm                h.i.ln_1                                     layers.i.input_layernorm
layers.i.attention.qkv             h.i.attn.c_attn (``[Q; K; V]``)^T            cat(q_proj, k_proj, v_proj)
layers.i.attention.dense           h.i.attn.c_proj^T                            o_proj
layers.i.post_attention_norm       h.i.ln_2                                     post_attention_layernorm
layers.i.mlp.fc1                   h.i.mlp.c_fc^T                               cat(gate_proj, up_proj)
layers.i.mlp.fc2                   h.i.mlp.c_proj^T                             down_proj
final_norm                         ln_f                                         norm
output_layer.weight                (tied: lm_head = wte)                        lm_head.weight (untied)
=================================  ===========================================  ==============================

Both use the same head layout and RoPE convention as megazero (head-major rows, rotate-half), so
no permutation is needed. ``load_hf(model, source)`` takes an HF state dict or a saved folder
(``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``); ``to_hf_state_dict(model)``
goes back (a collective over TP); ``config_from_hf`` builds the :class:`GPTConfig`.
``Qwen2ForCausalLM`` maps as Llama, its QKV bias (and no other: ``--add-qkv-bias``) included
(:mod:`.hf_qwen2`). ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` map as Llama outside their
MoE blocks, whose mapping (and routing equivalences) is in :mod:`.hf_moe`. ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` (per-head ``q_norm`` / ``k_norm`` -> ``layers.i.attention.q_norm`` /
``k_norm``) and ``MistralForCausalLM``, and every sliding window, are :mod:`.hf_families`'. A saved
folder is read by :mod:`.hf_files`.
"""

from __future__ import annotations

import os

import torch

from megazero.model.config import GPTConfig
from .hf_files import WEIGHT_FILES, hf_weights, read_hf_folder  # noqa: F401 (the converter's names)
from .hf_moe import (MOE_ARCHS, fuse_experts, gather_experts, hf_moe_config, moe_arch_of_config, moe_fields,
                     moe_layer_map, unfuse_experts)
from .hf_families import FAMILY_ARCHS, attention_fields, export_problems, family_config
from .hf_qwen2 import QWEN2_ARCHS, qwen2_config, qwen2_fields
from .hf_deepseek import (DEEPSEEK_ARCHS, deepseek_fields, deepseek_hf_config, deepseek_name_map, mla_mtp_flags,  # noqa: F401
                          gather_mtp_experts, mtp_copies, saved_buffers, without_missing_mtp)

ARCHS = ("gpt2", "llama", "qwen2") + tuple(FAMILY_ARCHS) + tuple(MOE_ARCHS) + tuple(DEEPSEEK_ARCHS)

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                    "gelu": "gelu"}


def _as_dict(hf_config) -> dict:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def arch_of(hf: dict) -> str:
    """``gpt2``, ``llama``, ``qwen2``, ``mixtral`` or ``qwen2_moe`` from an HF config dict
    (``model_type``) or state dict (its keys: a dense Qwen2's are ``llama``, whose mapping it shares)."""
    if "model_type" in hf:
        kind = hf["model_type"]
        if kind not in ARCHS:
            raise ValueError(f"unsupported model_type {kind!r} (one of {', '.join(ARCHS)})")
        return kind
    if any(k.startswith("transformer.wte") for k in hf):
        return "gpt2"
    if any(".kv_a_proj_with_mqa." in k for k in hf):
        return "deepseek_v3"
    if any(".self_attn.q_norm." in k for k in hf):
        return "qwen3_moe" if any(".mlp.experts." in k or ".mlp.gate." in k for k in hf) else "qwen3"
    if any(".shared_expert" in k for k in hf):
        return "qwen2_moe"
    if any(".block_sparse_moe." in k or ".mlp.experts." in k for k in hf):
        return "mixtral"
    if any(k.endswith("embed_tokens.weight") for k in hf):
        return "llama"
    raise ValueError("cannot tell GPT-2 / Llama / Qwen2 / Mixtral / Qwen2-MoE apart by these keys")


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """A :class:`GPTConfig` equal in architecture to an HF ``GPT2Config`` / ``LlamaConfig`` /
    ``Qwen2Config`` / ``MixtralConfig`` / ``Qwen2MoeConfig`` (or its dict)."""
    c = _as_dict(hf_config)
    arch = arch_of(c)
    if arch == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise ValueError(f"unsupported GPT-2 activation {act!r}")
        if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
            raise ValueError("only GPT-2's default 1/sqrt(d) attention scaling is supported")
        kw = dict(num_layers=c["n_layer"], hidden_size=c["n_embd"], num_attention_heads=c["n_head"],
                  vocab_size=c["vocab_size"], ffn_hidden_size=c.get("n_inner") or 4 * c["n_embd"],
                  seq_length=c["n_positions"], max_position_embeddings=c["n_positions"],
                  position_embedding_type="learned_absolute", normalization="LayerNorm",
                  norm_epsilon=c.get("layer_norm_epsilon", 1e-5), activation=GPT2_ACTIVATIONS[act],
                  add_bias_linear=True, untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
                  attention_dropout=c.get("attn_pdrop", 0.1), hidden_dropout=c.get("resid_pdrop", 0.1),
                  init_method_std=c.get("initializer_range", 0.02))
    elif arch in DEEPSEEK_ARCHS:
        kw = deepseek_fields(c)
    else:
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
            raise ValueError(f"config {key} rope_type={rope.get('rope_type', rope.get('type'))!r}: megazero's RoPE "
                             "has no scaling (only rope_type 'default' converts)")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation hidden_act={c.get('hidden_act')!r} (SwiGLU needs silu)")
        if bool(c.get("attention_bias", False)) != bool(c.get("mlp_bias", False)):
            raise ValueError(f"config attention_bias={c.get('attention_bias', False)!r} with mlp_bias="
                             f"{c.get('mlp_bias', False)!r}: they must agree (one --disable-bias-linear flag)")
        heads = c["num_attention_heads"]
        kw = dict(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=heads,
                  num_query_groups=c.get("num_key_value_heads") or heads,
                  kv_channels=c.get("head_dim") or c["hidden_size"] // heads, vocab_size=c["vocab_size"],
                  ffn_hidden_size=c["intermediate_size"], seq_length=c.get("max_position_embeddings", 2048),
                  max_position_embeddings=c.get("max_position_embeddings", 2048), position_embedding_type="rope",
                  rotary_base=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), normalization="RMSNorm",
                  norm_epsilon=c.get("rms_norm_eps", 1e-6), activation="swiglu",
                  add_bias_linear=bool(c.get("attention_bias", False)),
                  untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                  attention_dropout=c.get("attention_dropout", 0.0), hidden_dropout=0.0,
                  init_method_std=c.get("initializer_range", 0.02))
        kw.update(attention_fields(c, arch, kw["num_layers"]))
        if arch in QWEN2_ARCHS:
            kw.update(qwen2_fields(c, arch))
        if arch in MOE_ARCHS:
            kw.update(moe_fields(c, arch, kw["num_layers"]))
    kw.update(overrides)
    return GPTConfig(**kw)


def _layer_map(arch: str, i: int) -> dict[str, list[tuple[str, bool]]]:
    """megazero layer-``i`` suffix -> [(HF name, transpose)] whose rows are concatenated."""
    if arch == "gpt2":
        h = f"transformer.h.{i}."
        return {"input_norm.weight": [(h + "ln_1.weight", False)], "input_norm.bias": [(h + "ln_1.bias", False)],
                "attention.qkv.weight": [(h + "attn.c_attn.weight", True)],
                "attention.qkv.bias": [(h + "attn.c_attn.bias", False)],
                "attention.dense.weight": [(h + "attn.c_proj.weight", True)],
                "attention.dense.bias": [(h + "attn.c_proj.bias", False)],
                "post_attention_norm.weight": [(h + "ln_2.weight", False)],
                "post_attention_norm.bias": [(h + "ln_2.bias", False)],
                "mlp.fc1.weight": [(h + "mlp.c_fc.weight", True)], "mlp.fc1.bias": [(h + "mlp.c_fc.bias", False)],
                "mlp.fc2.weight": [(h + "mlp.c_proj.weight", True)], "mlp.fc2.bias": [(h + "mlp.c_proj.bias", False)]}
    h = f"model.layers.{i}."
    m = {"input_norm.weight": [(h + "input_layernorm.weight", False)],
         "post_attention_norm.weight": [(h + "post_attention_layernorm.weight", False)],
         "attention.dense.weight": [(h + "self_attn.o_proj.weight", False)],
         "mlp.fc2.weight": [(h + "mlp.down_proj.weight", False)]}
    for kind in ("weight", "bias"):
        m[f"attention.qkv.{kind}"] = [(h + f"self_attn.{x}_proj.{kind}", False) for x in "qkv"]
        m[f"mlp.fc1.{kind}"] = [(h + f"mlp.{x}_proj.{kind}", False) for x in ("gate", "up")]
    m["attention.dense.bias"] = [(h + "self_attn.o_proj.bias", False)]
    m.update({f"attention.{x}_norm.weight": [(h + f"self_attn.{x}_norm.weight", False)] for x in "qk"})  # Qwen3
    m["mlp.fc2.bias"] = [(h + "mlp.down_proj.bias", False)]
    return m


def _global_map(arch: str) -> dict[str, list[tuple[str, bool]]]:
    if arch == "gpt2":
        return {"embedding.word_embeddings.weight": [("transformer.wte.weight", False)],
                "embedding.position_embeddings.weight": [("transformer.wpe.weight", False)],
                "final_norm.weight": [("transformer.ln_f.weight", False)],
                "final_norm.bias": [("transformer.ln_f.bias", False)],
                "output_layer.weight": [("lm_head.weight", False)]}
    return {"embedding.word_embeddings.weight": [("model.embed_tokens.weight", False)],
            "final_norm.weight": [("model.norm.weight", False)],
            "output_layer.weight": [("lm_head.weight", False)]}


def name_map(arch: str, config) -> dict[str, list[tuple[str, bool]]]:
    """megazero name -> [(HF name, transpose)] for a :class:`GPTConfig` (or a dense model's layer count)."""
    if arch in DEEPSEEK_ARCHS:
        return deepseek_name_map(config)
    num_layers, moe = (config, None) if isinstance(config, int) else (config.num_layers, config.moe)
    m = _global_map(arch)
    for i in range(num_layers):
        layer = _layer_map(arch, i)
        if moe is not None and moe.is_moe(i):
            layer = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
            layer.update(moe_layer_map(arch, i, moe))
        m.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return m


def hf_to_full(hf_state: dict, config: GPTConfig, arch: str | None = None) -> dict[str, torch.Tensor]:
    """HF state dict -> megazero full state dict (names present in ``hf_state`` only)."""
    arch = arch or arch_of(hf_state)
    if arch in MOE_ARCHS or arch in DEEPSEEK_ARCHS:
        hf_state = unfuse_experts(hf_state, arch)
    out = {}
    for name, sources in name_map(arch, config).items():
        if not all(src in hf_state for src, _ in sources):
            continue
        parts = [hf_state[src].t() if transpose else hf_state[src] for src, transpose in sources]
        out[name] = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
    if config.tied_embeddings and "embedding.word_embeddings.weight" in out:
        out.pop("output_layer.weight", None)  # the model uses (or copies) the embedding
    if config.apply_layernorm_1p:  # --apply-layernorm-1p stores w where HF stores the scale 1 + w
        out = {k: v - 1 if k.endswith("norm.weight") else v for k, v in out.items()}
    return out


def full_to_hf(full_state: dict, config: GPTConfig, arch: str) -> dict[str, torch.Tensor]:
    """megazero full state dict -> HF state dict (the inverse of :func:`hf_to_full`)."""
    d, heads, groups = config.kv_channels, config.num_attention_heads, config.num_query_groups
    qkv = [heads * d, groups * d, groups * d]
    out = {}
    for name, targets in name_map(arch, config).items():
        if name not in full_state:
            continue
        t = full_state[name]
        if config.apply_layernorm_1p and name.endswith("norm.weight"):
            t = t + 1  # HF's norm scale is --apply-layernorm-1p's 1 + w
        if len(targets) > 1:  # fused q/k/v rows, or an fc1's [gate; up] halves
            pieces = t.split(qkv, 0) if ".attention.qkv." in name else t.chunk(len(targets), 0)
        else:
            pieces = [t]
        for (dst, transpose), piece in zip(targets, pieces):
            out[dst] = (piece.t() if transpose else piece).contiguous()
    if config.tied_embeddings and "embedding.word_embeddings.weight" in full_state:
        out["lm_head.weight"] = full_state["embedding.word_embeddings.weight"]
    return dict(out, **mtp_copies(full_state, config)) if arch in DEEPSEEK_ARCHS else out


def load_hf(model, source) -> list[str]:
    """Load an HF state dict, or a folder path, into ``model`` (any TP size or pipeline slice).

    Returns the model's parameter names that the source lacked (none for a full model).
    """
    state = read_hf_folder(source)[1] if isinstance(source, (str, os.PathLike)) else source
    full = hf_to_full(state, model.config, arch_of(state))
    buffers = dict(model.named_buffers())  # an MoE router's expert bias (DeepSeek-V3's correction bias)
    for name in [k for k in full if k in buffers]:
        buffers[name].copy_(full.pop(name))
    full = {k: v.to(model.config.params_dtype) for k, v in full.items()}
    return model.load_full_state_dict(full, strict=False)


def to_hf_state_dict(model, arch: str | None = None, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The model's (or slice's) weights as an HF state dict; collective over the TP group (and,
    for an MoE model at EP > 1, over the EP group: every expert is in it). Experts under the
    Hub's per-expert names, or ``fused_experts`` as transformers >= 5 holds them in memory."""
    arch = arch or arch_of_config(model.config)
    full = dict(model.full_state_dict(), **{k: v for k, v in model.state_dict().items() if k.endswith("expert_bias")})
    out = full_to_hf(gather_mtp_experts(model, gather_experts(model, full)), model.config, arch)
    moe_arch = arch in MOE_ARCHS or arch in DEEPSEEK_ARCHS
    return fuse_experts(out, arch, model.config.moe) if fused_experts and moe_arch else out


def arch_of_config(config) -> str:
    """The HF architecture a :class:`GPTConfig` exports as by default: MoE per :mod:`.hf_moe`;
    MLA ``deepseek_v3``; RoPE with QK-norm ``qwen3``, with a QKV-only bias ``qwen2``, with a window
    ``mistral``, other RoPE ``llama``; learned positions ``gpt2``."""
    if config.multi_latent_attention:
        return "deepseek_v3"
    if config.moe is not None:
        return moe_arch_of_config(config)
    if config.position_embedding_type != "rope":
        return "gpt2"
    if config.qk_layernorm:
        return "qwen3"
    if config.add_qkv_bias and not config.add_bias_linear:
        return "qwen2"
    return "mistral" if config.window_size is not None else "llama"


def hf_config_of(config: GPTConfig, arch: str) -> dict:
    """The HF ``config.json`` of a :class:`GPTConfig` (refusing what the architecture can't express)."""
    c = config
    if (c.moe is not None) != (arch in MOE_ARCHS) and arch not in DEEPSEEK_ARCHS:
        raise ValueError(f"a {'MoE' if c.moe is not None else 'dense'} model does not export as {arch!r} "
                         f"(MoE: {' or '.join(MOE_ARCHS)}; dense: gpt2, llama or qwen2)")
    if arch == "gpt2":
        bad = [m for m, ok in (("learned_absolute positions", c.position_embedding_type == "learned_absolute"),
                               ("LayerNorm", c.normalization == "LayerNorm"), ("biases", c.add_bias_linear),
                               ("gelu/gelu_tanh", c.activation in ("gelu", "gelu_tanh")),
                               ("no GQA", c.num_query_groups == c.num_attention_heads),
                               ("kv_channels = hidden / heads", c.kv_channels * c.num_attention_heads == c.hidden_size))
               if not ok] + export_problems(c, arch)
        if bad:
            raise ValueError(f"GPT-2 export needs: {', '.join(bad)}")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
                "n_positions": c.max_position_embeddings, "n_embd": c.hidden_size, "n_layer": c.num_layers,
                "n_head": c.num_attention_heads, "n_inner": c.ffn_hidden_size,
                "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
                "layer_norm_epsilon": c.norm_epsilon, "initializer_range": c.init_method_std,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": c.tied_embeddings, "torch_dtype": "float32"}
    bad = [m for m, ok in (("RoPE", c.position_embedding_type == "rope"), ("RMSNorm", c.normalization == "RMSNorm"),
                           ("SwiGLU", c.activation == "swiglu"),
                           ("no QKV-only bias (--add-qkv-bias: export as qwen2)",
                            arch != "llama" or c.qkv_bias == c.add_bias_linear)) if not ok]
    bad += [] if arch in DEEPSEEK_ARCHS else export_problems(c, arch)  # DeepSeek-V3's own checks: hf_deepseek
    if bad:
        name = {**MOE_ARCHS, **QWEN2_ARCHS, **FAMILY_ARCHS}.get(arch, "Llama")
        raise ValueError(f"{name} export needs: {', '.join(bad)}")
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_query_groups,
            "head_dim": c.kv_channels, "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.norm_epsilon, "rope_theta": float(c.rotary_base),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(c.rotary_base)},
            "attention_bias": c.add_bias_linear, "mlp_bias": c.add_bias_linear, "hidden_act": "silu",
            "initializer_range": c.init_method_std, "tie_word_embeddings": c.tied_embeddings,
            "attention_dropout": 0.0, "torch_dtype": "float32"}
    if arch == "qwen2":
        return qwen2_config(c, llama)
    if arch in DEEPSEEK_ARCHS:
        return deepseek_hf_config(c, llama)
    if arch in FAMILY_ARCHS:
        return family_config(c, arch, llama)
    return hf_moe_config(c, arch, llama) if arch in MOE_ARCHS else llama
