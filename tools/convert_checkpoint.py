#!/usr/bin/env python
"""Convert megazero checkpoints (any layout) to one fp32 state dict or a Hugging Face folder, and
Hugging Face folders back to a megazero checkpoint.  One process, no torch.distributed.

    python tools/convert_checkpoint.py to-fp32 --load DIR [--iteration N] --output model_fp32.pt
    python tools/convert_checkpoint.py to-hf   --load DIR [--iteration N] --output HF_DIR [--arch gpt2|llama]
                                               [--dtype float32|bfloat16|float16]
    python tools/convert_checkpoint.py from-hf --hf HF_DIR --save DIR [--iteration 0] [--dtype float32]

``to-fp32`` (DeepSpeed's ``zero_to_fp32`` use-case): ``{name: full fp32 tensor}`` of the fp32
master weights (the parameters when the checkpoint has no optimizer state), real vocabulary rows
only, tied output layer left out; written with ``torch.save``, loadable with ``weights_only=True``.

``to-hf``: ``config.json`` + ``model.safetensors`` for ``GPT2LMHeadModel`` (learned positions,
LayerNorm, GELU, biases, tied embeddings) or ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU);
the tensor mapping is :mod:`megazero.model.hf`'s.  No tokenizer files are written.

``from-hf``: a one-rank megazero checkpoint (TP 1, PP 1, DP 1, ZeRO 0) holding the weights and
no optimizer state (``no_save_optim``), at ``--iteration`` (0 by default) with no LR-scheduler
state.  ``pretrain_gpt.py --load DIR`` in any layout reshards it: fp32 masters = the weights,
Adam moments zero, step 0 -- a fresh optimizer on the imported weights.  The matching model flags
are printed.

Memory: the reader streams one full parameter at a time out of memory-mapped rank files; the
output is built in memory once (about one copy of the weights), then written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint import files, schema  # noqa: E402
from megazero.checkpoint.reader import CheckpointReader  # noqa: E402
from megazero.checkpoint.schema import CheckpointError  # noqa: E402
from megazero.model import hf as hfmap  # noqa: E402
from megazero.model.config import GPTConfig  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".partial")
    os.replace(path + ".partial", path)


# ---- megazero -> consolidated fp32 ----------------------------------------------------------
def to_fp32(load: str, output: str, iteration: int | None = None) -> dict:
    reader = CheckpointReader(load, iteration)
    kind = "master" if reader.has_optimizer else "weight"
    out = {name: t.float() for name, t in reader.iter_full_params(kind)}
    _atomic_save(out, output)
    return out


# ---- megazero -> Hugging Face -----------------------------------------------------------------
def arch_of_config(config) -> str:
    return "llama" if config.position_embedding_type == "rope" else "gpt2"


def hf_config(config, arch: str) -> dict:
    """The HF ``config.json`` of a :class:`GPTConfig` (refusing what the architecture can't express)."""
    c = config
    if arch == "gpt2":
        bad = [m for m, ok in (("learned_absolute positions", c.position_embedding_type == "learned_absolute"),
                               ("LayerNorm", c.normalization == "LayerNorm"), ("biases", c.add_bias_linear),
                               ("gelu/gelu_tanh", c.activation in ("gelu", "gelu_tanh")),
                               ("no GQA", c.num_query_groups == c.num_attention_heads),
                               ("kv_channels = hidden / heads", c.kv_channels * c.num_attention_heads == c.hidden_size))
               if not ok]
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
                           ("SwiGLU", c.activation == "swiglu")) if not ok]
    if bad:
        raise ValueError(f"Llama export needs: {', '.join(bad)}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_query_groups,
            "head_dim": c.kv_channels, "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.norm_epsilon, "rope_theta": float(c.rotary_base),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(c.rotary_base)},
            "attention_bias": c.add_bias_linear, "mlp_bias": c.add_bias_linear, "hidden_act": "silu",
            "initializer_range": c.init_method_std, "tie_word_embeddings": c.tied_embeddings,
            "attention_dropout": 0.0, "torch_dtype": "float32"}


def to_hf(load: str, output: str, iteration: int | None = None, arch: str | None = None,
          dtype: str = "float32") -> str:
    from safetensors.torch import save_file
    reader = CheckpointReader(load, iteration)
    config = GPTConfig.from_saved_args(reader.args)
    arch = arch or arch_of_config(config)
    cfg = dict(hf_config(config, arch), torch_dtype=dtype)
    kind = "master" if reader.has_optimizer else "weight"
    state = {}
    for name, full in reader.iter_full_params(kind, DTYPES[dtype]):
        state.update(hfmap.full_to_hf({name: full}, config, arch))  # one parameter at a time
    if config.tied_embeddings:
        state.pop("lm_head.weight", None)  # tied: transformers re-ties it to the input embedding
    os.makedirs(output, exist_ok=True)
    save_file(state, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
    return output


# ---- Hugging Face -> megazero -----------------------------------------------------------------
def _hf_tensors(folder: str):
    """A getter of one HF tensor by name: memory-mapped safetensors, else a ``weights_only`` .bin."""
    st = os.path.join(folder, "model.safetensors")
    if os.path.isfile(st):
        from safetensors import safe_open
        handle = safe_open(st, framework="pt")
        return handle.get_tensor, set(handle.keys())
    state = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True, mmap=True)
    return state.__getitem__, set(state)


def model_args(config, dtype: torch.dtype) -> dict:
    """The saved ``args`` of an imported model: the model's (``config.to_args``, TP 1) and what
    :class:`CheckpointReader` and ``--load`` read (no optimizer state, one rank)."""
    return {**config.to_args(1), "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout, "sequence_parallel": False, "recompute_granularity": None,
            "recompute_method": None, "recompute_num_layers": None,
            "params_dtype": str(dtype).replace("torch.", ""), "no_save_optim": True, "world_size": 1}


def pretrain_flags(config) -> str:
    c = config
    flags = [f"--num-layers {c.num_layers}", f"--hidden-size {c.hidden_size}",
             f"--num-attention-heads {c.num_attention_heads}", f"--ffn-hidden-size {c.ffn_hidden_size}",
             f"--max-position-embeddings {c.max_position_embeddings}", f"--vocab-size {c.vocab_size}",
             f"--position-embedding-type {c.position_embedding_type}", f"--normalization {c.normalization}",
             f"--norm-epsilon {c.norm_epsilon}"]
    if c.num_query_groups != c.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {c.num_query_groups}")
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        flags.append(f"--kv-channels {c.kv_channels}")
    if c.position_embedding_type == "rope":
        flags.append(f"--rotary-base {int(c.rotary_base)}")
    flags += [f for f, on in (("--swiglu", c.activation == "swiglu"), ("--disable-bias-linear", not c.add_bias_linear),
                              ("--untie-embeddings-and-output-weights", c.untie_embeddings_and_output_weights)) if on]
    if c.activation == "gelu_tanh":
        flags.append("(note: megazero trains with exact gelu; GPT-2 used the tanh approximation)")
    return " ".join(flags)


def from_hf(hf_dir: str, save: str, iteration: int = 0, dtype: str = "float32"):
    """Write ``save/iter_NNNNNNN/`` (see module doc); returns the :class:`GPTConfig`."""
    from megazero.checkpoint.reshard import named_parameters
    from megazero.model import GPTModel
    from megazero.model.gpt import WORD_EMBEDDING
    with open(os.path.join(hf_dir, "config.json")) as fh:
        cfg = json.load(fh)
    arch = hfmap.arch_of(cfg)
    config = hfmap.config_from_hf(cfg)
    get, have = _hf_tensors(hf_dir)
    mapping = hfmap.name_map(arch, config.num_layers)
    # templates give each parameter's module (TP split rule, vocab padding) without building the model:
    # embedding + head, and one layer whose names are renumbered
    ends = GPTModel(config, None, layer_start=0, layer_end=0, pre_process=True, post_process=True)
    layer = GPTModel(config, None, layer_start=0, layer_end=1, pre_process=False, post_process=False)
    entries = list(named_parameters([ends]))
    per_layer = list(named_parameters([layer]))
    first = [e for e in entries if e[1].startswith("embedding.")]
    ordered = first + [(0, name.replace("layers.0.", f"layers.{i}.", 1), m, pn, p, sp)
                       for i in range(config.num_layers) for _, name, m, pn, p, sp in per_layer]
    ordered += [e for e in entries if not e[1].startswith("embedding.")]
    sd, params = {}, []
    target = DTYPES[dtype]
    for _, name, module, p_name, p, split in ordered:
        sources = mapping[name]
        missing = [s for s, _ in sources if s not in have]
        if missing:
            raise KeyError(f"{hf_dir}: {name} needs {missing}")
        parts = [get(s).t() if transpose else get(s) for s, transpose in sources]
        full = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        local = full if split is None else split.to_local(full, 0, 1, local_rows=p.shape[split.dim])
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{name}: HF tensor gives {tuple(local.shape)}, expected {tuple(p.shape)}")
        sd[name] = local.to(target).contiguous()
        params.append(schema.ParamEntry(0, name, tuple(p.shape), split))
    del ends, layer
    aliases = {"output_layer.weight": WORD_EMBEDDING} if config.tied_embeddings else {}
    index = schema.make_index([schema.index_entry(0, 0, 0, 0, params, regions=[])], aliases)
    metadata = schema.metadata(iteration, 0, schema.layout(1, 1, 1, None, 1, 0, target), model_args(config, target),
                               index, imported_from=os.path.abspath(hf_dir))
    state = schema.rank_state([sd], scheduler=None, counters={"skipped": 0, "nans": 0})
    files.save_checkpoint(save, iteration, 0, state, metadata)
    return config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-fp32")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, default=None)
    a.add_argument("--output", required=True)
    b = sub.add_parser("to-hf")
    b.add_argument("--load", required=True)
    b.add_argument("--iteration", type=int, default=None)
    b.add_argument("--output", required=True)
    b.add_argument("--arch", choices=["gpt2", "llama"], default=None, help="default: llama with RoPE, else gpt2")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    c = sub.add_parser("from-hf")
    c.add_argument("--hf", required=True)
    c.add_argument("--save", required=True)
    c.add_argument("--iteration", type=int, default=0)
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        if args.cmd == "to-fp32":
            out = to_fp32(args.load, args.output, args.iteration)
            print(f"wrote {len(out)} fp32 tensors ({sum(t.numel() for t in out.values()):,} parameters) to "
                  f"{args.output} in {time.time() - t0:.2f} s")
        elif args.cmd == "to-hf":
            to_hf(args.load, args.output, args.iteration, args.arch, args.dtype)
            print(f"wrote {args.output}/config.json and model.safetensors in {time.time() - t0:.2f} s")
        else:
            config = from_hf(args.hf, args.save, args.iteration, args.dtype)
            print(f"wrote {schema.iteration_dir(args.save, args.iteration)} in {time.time() - t0:.2f} s; "
                  f"train it with: --load {args.save} {pretrain_flags(config)}")
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
