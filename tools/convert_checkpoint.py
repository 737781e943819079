#!/usr/bin/env python
"""Convert megazero checkpoints (any layout) to one fp32 state dict or a Hugging Face folder, and
Hugging Face folders back to a megazero checkpoint.  One process, no torch.distributed.

    python tools/convert_checkpoint.py to-fp32 --load DIR [--iteration N] --output model_fp32.pt
    python tools/convert_checkpoint.py to-hf   --load DIR [--iteration N] --output HF_DIR
                                               [--arch gpt2|llama|qwen2|qwen3|mistral|mixtral|qwen2_moe|qwen3_moe]
                                               [--dtype float32|bfloat16|float16]
    python tools/convert_checkpoint.py from-hf --hf HF_DIR --save DIR [--iteration 0] [--dtype float32]
    python tools/convert_checkpoint.py from-megatron --load MEGATRON_DIR --save DIR [--iteration N]
                                               [--vocab-size V] [--dtype float32]

``to-fp32`` (DeepSpeed's ``zero_to_fp32`` use-case): ``{name: full fp32 tensor}`` of the fp32
master weights (the parameters when the checkpoint has no optimizer state), real vocabulary rows
only, tied output layer left out; written with ``torch.save``, loadable with ``weights_only=True``.

``to-hf``: ``config.json`` + ``model.safetensors`` for ``GPT2LMHeadModel`` (learned positions,
LayerNorm, GELU, biases, tied embeddings), ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU) or
``Qwen2ForCausalLM`` (``--add-qkv-bias``), ``Qwen3ForCausalLM`` (``--qk-layernorm``) or ``MistralForCausalLM``
(``--window-size``); MoE: ``MixtralForCausalLM`` (every layer MoE, no shared expert), ``Qwen2MoeForCausalLM`` (a
gated shared expert; dense layers as ``mlp_only_layers``) or ``Qwen3MoeForCausalLM`` (no shared expert), experts
under the Hub's per-expert names; the tensor mapping is :mod:`megazero.checkpoint.convert.hf`'s.  The checkpoint's tokenizer (recorded flags) is
written as HF tokenizer files, so ``AutoTokenizer.from_pretrained(HF_DIR)`` loads it.

``from-hf``: a one-rank megazero checkpoint (TP 1, PP 1, DP 1, ZeRO 0) holding the weights and
no optimizer state (``no_save_optim``), at ``--iteration`` (0 by default) with no LR-scheduler
state.  ``pretrain_gpt.py --load DIR`` in any layout reshards it: fp32 masters = the weights,
Adam moments zero, step 0 -- a fresh optimizer on the imported weights.  The matching model flags
are printed (``--openai-gelu`` for GPT-2's tanh GELU, ``--add-qkv-bias`` for Qwen2's QKV bias).
The folder's tokenizer files are copied to ``DIR/tokenizer/`` and the tokenizer type recorded,
so ``generate.py --load DIR`` and ``pretrain_gpt.py --load DIR`` need no tokenizer flag.

``from-megatron``: the same from a Megatron-LM legacy checkpoint (``torch`` format:
``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` or ``release/``), any TP x PP (x VP),
legacy ``language_model.*`` or mcore ``decoder.*`` names; see :mod:`megazero.checkpoint.convert.megatron`;
or from a ``torch_dist`` one (``iter_NNNNNNN/.metadata``, read with ``torch.distributed.checkpoint``:
:mod:`megazero.checkpoint.convert.megatron_dist`).

Memory: the reader streams one full parameter at a time out of memory-mapped rank files.
``to-hf`` writes ``model.safetensors`` incrementally (header from the shapes first, then one
tensor after another: :mod:`megazero.checkpoint.safetensors_stream`), so it holds one parameter;
so does ``to-fp32`` (a ``torch.save`` skeleton first, then each tensor's bytes into its place:
:mod:`megazero.checkpoint.torch_stream`).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint import files, schema  # noqa: E402
from megazero.checkpoint.guard import check_output  # noqa: E402
from megazero.checkpoint.reader import CheckpointReader  # noqa: E402
from megazero.checkpoint.safetensors_stream import SafetensorsWriter  # noqa: E402
from megazero.checkpoint.schema import CheckpointError  # noqa: E402
from megazero.checkpoint.torch_stream import save_streamed  # noqa: E402
from megazero.config.failures import debug_requested, describe  # noqa: E402
from megazero.checkpoint.convert import hf as hfmap  # noqa: E402
from megazero.checkpoint.convert.pretrain_flags import pretrain_flags  # noqa: E402,F401
from megazero.model.config import GPTConfig  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- megazero -> consolidated fp32 ----------------------------------------------------------
def to_fp32(load: str, output: str, iteration: int | None = None) -> dict:
    """Stream ``{name: full fp32 tensor}`` into ``output`` one parameter at a time
    (:mod:`megazero.checkpoint.torch_stream`); returns the written file memory-mapped."""
    reader = CheckpointReader(load, iteration)
    kind = "master" if reader.has_optimizer else "weight"
    names = reader.param_names()
    specs = [(name, reader.full_meta(name, kind).shape, torch.float32) for name in names]
    save_streamed(output, specs, ((name, reader.full_param(name, kind).float()) for name in names))
    return torch.load(output, mmap=True, weights_only=True)


# ---- megazero -> Hugging Face -----------------------------------------------------------------
def to_hf(load: str, output: str, iteration: int | None = None, arch: str | None = None,
          dtype: str = "float32") -> str:
    from megazero.data.hf_tokenizer import export_tokenizer_files
    from megazero.data.tokenizers import TokenizerConfig, build_tokenizer, saved_tokenizer_flags
    reader = CheckpointReader(load, iteration)
    config = GPTConfig.from_saved_args(reader.args)
    arch = arch or hfmap.arch_of_config(config)
    cfg = dict(hfmap.hf_config_of(config, arch), torch_dtype=dtype)
    kind, target = ("master" if reader.has_optimizer else "weight"), DTYPES[dtype]
    os.makedirs(output, exist_ok=True)
    flags = saved_tokenizer_flags(reader.args, load)
    if flags and export_tokenizer_files(flags, output):
        tok = build_tokenizer(TokenizerConfig.from_flags({**flags, "vocab_size": reader.args.get("vocab_size")}))
        cfg.update({k: v for k, v in (("bos_token_id", getattr(tok, "bos", None)), ("eos_token_id", tok.eod))
                    if v is not None and v >= 0})
    _stream_hf(reader, config, arch, kind, target, os.path.join(output, "model.safetensors"))
    with open(os.path.join(output, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
    return output


def _stream_hf(reader, config, arch: str, kind: str, dtype: torch.dtype, path: str) -> None:
    """``model.safetensors`` written one parameter at a time: the header from meta tensors of the
    HF names and shapes (:meth:`CheckpointReader.full_meta`, nothing read), then each full
    parameter read, mapped (:func:`megazero.checkpoint.convert.hf.full_to_hf`: one megazero parameter gives
    one or more HF tensors), written and freed. A tied output layer is left out (transformers
    re-ties ``lm_head.weight`` to the input embedding)."""
    def hf_of(name: str, full: torch.Tensor) -> dict:
        out = hfmap.full_to_hf({name: full}, config, arch)
        if config.tied_embeddings:
            out.pop("lm_head.weight", None)
        return out
    names = reader.param_names() + hfmap.saved_buffers(reader, arch, config)  # DeepSeek's correction bias
    specs = [item for name in names for item in hf_of(name, reader.full_meta(name, kind).to(dtype)).items()]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
        for name in names:
            for hf_name, tensor in hf_of(name, reader.full_param(name, kind).to(dtype)).items():
                writer.write(hf_name, tensor)


# ---- Hugging Face / Megatron-LM -> megazero -----------------------------------------------------
def model_args(config, dtype: torch.dtype) -> dict:
    """The saved ``args`` of an imported model: the model's (``config.to_args``, TP 1) and what
    :class:`CheckpointReader` and ``--load`` read (no optimizer state, one rank)."""
    return {**config.to_args(1), "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout, "sequence_parallel": False, "recompute_granularity": None,
            "recompute_method": None, "recompute_num_layers": None,
            "params_dtype": str(dtype).replace("torch.", ""), "no_save_optim": True, "world_size": 1}


def write_imported(save: str, config, full_tensor, iteration: int, dtype: str, extra_args: dict, source: str):
    """A one-rank megazero checkpoint (TP 1, DP 1, ZeRO 0, no optimizer state) of ``config``'s
    parameters, ``full_tensor(name)`` giving each full, unpadded tensor under megazero's names;
    persistent buffers (an MoE router's ``expert_bias``) too where the source has them (else
    left out: a run loading it keeps its own, zeros)."""
    from megazero.checkpoint.reshard import is_expert, named_parameters, persistent_buffers
    from megazero.model import GPTModel
    from megazero.model.gpt import WORD_EMBEDDING
    # a meta-device model gives each parameter's module (TP split rule, vocab padding, expert or
    # not) and the order, drawing nothing
    template = GPTModel(config, None, meta_init=True)
    sd, params, buffers, target = {}, [], [], DTYPES[dtype]
    for _, name, module, p_name, p, split in named_parameters([template]):
        full = full_tensor(name)
        local = full if split is None else split.to_local(full, 0, 1, local_rows=p.shape[split.dim])
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{name}: the source gives {tuple(local.shape)}, expected {tuple(p.shape)}")
        sd[name] = local.to(target).contiguous()
        params.append(schema.ParamEntry(0, name, tuple(p.shape), split, expert=is_expert(module)))
    for _, name, buf in persistent_buffers([template]):
        try:
            value = full_tensor(name)
        except (KeyError, CheckpointError):
            print(f"note: the source has no {name}; a run loading this checkpoint keeps its own")
            continue
        sd[name] = value.to(buf.dtype).reshape(buf.shape).contiguous()
        buffers.append(schema.ParamEntry(0, name, tuple(buf.shape), None))
    del template
    aliases = {"output_layer.weight": WORD_EMBEDDING} if config.tied_embeddings else {}
    expert = (0, 0, 0) if any(p.expert for p in params) else None
    index = schema.make_index([schema.index_entry(0, 0, 0, 0, params, [], expert, buffers)], aliases)
    metadata = schema.metadata(iteration, 0, schema.layout(1, 1, 1, None, 1, 0, target),
                               {**model_args(config, target), **extra_args}, index, imported_from=source)
    state = schema.rank_state([sd], scheduler=None, counters={"skipped": 0, "nans": 0})
    files.save_checkpoint(save, iteration, 0, state, metadata)


def from_hf(hf_dir: str, save: str, iteration: int = 0, dtype: str = "float32"):
    """Write ``save/iter_NNNNNNN/`` and ``save/tokenizer/`` (see module doc); returns
    (:class:`GPTConfig`, recorded tokenizer flags)."""
    from megazero.data.hf_tokenizer import import_tokenizer_files
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"--hf {hf_dir}: no config.json there, so it is not a Hugging Face model folder "
                              "(give the folder holding config.json and the *.safetensors or *.bin weights)")
    try:
        with open(config_path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: cannot be read as JSON ({e})") from e
    arch = hfmap.arch_of(cfg)
    config = hfmap.config_from_hf(cfg)
    if arch == "gpt2" and cfg.get("embd_pdrop", 0.1) != cfg.get("resid_pdrop", 0.1):
        print(f"note: {config_path}: embd_pdrop {cfg.get('embd_pdrop', 0.1)} differs from resid_pdrop "
              f"{cfg.get('resid_pdrop', 0.1)}; Megatron's --hidden-dropout ({config.hidden_dropout:g}) drops both")
    get, have = hfmap.hf_weights(hf_dir)
    config = hfmap.without_missing_mtp(config, have, config_path)
    mapping = hfmap.name_map(arch, config)

    def full_tensor(name):
        sources = mapping[name]
        missing = [s for s, _ in sources if s not in have]
        if missing:
            raise KeyError(f"{hf_dir}: {name} needs {missing}")
        parts = [get(s).t() if transpose else get(s) for s, transpose in sources]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]

    tokenizer = import_tokenizer_files(hf_dir, save)
    write_imported(save, config, full_tensor, iteration, dtype, tokenizer, os.path.abspath(hf_dir))
    return config, tokenizer


def from_megatron(load: str, save: str, iteration: int | None = None, vocab_size: int | None = None,
                  dtype: str = "float32"):
    """Write a megazero checkpoint of a Megatron-LM legacy or torch_dist checkpoint (the latter told
    by its DCP ``.metadata`` file); returns (config, tokenizer flags, iteration)."""
    from megazero.checkpoint.convert.megatron import MegatronCheckpoint
    from megazero.checkpoint.convert.megatron_dist import MegatronDistCheckpoint, is_torch_dist
    kind = MegatronDistCheckpoint if is_torch_dist(load, iteration) else MegatronCheckpoint
    with kind(load, iteration, vocab_size=vocab_size) as ckpt:
        out_iteration = ckpt.iteration
        write_imported(save, ckpt.config, ckpt.full_tensor, out_iteration, dtype, ckpt.tokenizer_flags,
                       os.path.abspath(ckpt.directory))
        return ckpt.config, ckpt.tokenizer_flags, out_iteration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-fp32")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, default=None)
    a.add_argument("--output", required=True)
    a.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    b = sub.add_parser("to-hf")
    b.add_argument("--load", required=True)
    b.add_argument("--iteration", type=int, default=None)
    b.add_argument("--output", required=True)
    b.add_argument("--overwrite", action="store_true", help="write into a non-empty --output folder")
    b.add_argument("--arch", choices=list(hfmap.ARCHS), default=None,
                   help="default: mixtral / qwen2_moe (a shared expert) for MoE, else with RoPE qwen2 (a QKV-only "
                        "bias) or llama, else gpt2")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    c = sub.add_parser("from-hf")
    c.add_argument("--hf", required=True)
    c.add_argument("--save", required=True)
    c.add_argument("--iteration", type=int, default=0)
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    m = sub.add_parser("from-megatron")
    m.add_argument("--load", required=True, help="Megatron-LM checkpoint folder (latest_checkpointed_iteration.txt)")
    m.add_argument("--save", required=True)
    m.add_argument("--iteration", type=int, default=None, help="default: the tracker's (or release)")
    m.add_argument("--vocab-size", type=int, default=None,
                   help="real vocabulary rows (default: NullTokenizer's N + 1, else the padded size)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    try:
        check_outputs(args)
        if args.cmd == "to-fp32":
            out = to_fp32(args.load, args.output, args.iteration)
            print(f"wrote {len(out)} fp32 tensors ({sum(t.numel() for t in out.values()):,} parameters) to "
                  f"{args.output} in {time.time() - t0:.2f} s")
        elif args.cmd == "to-hf":
            to_hf(args.load, args.output, args.iteration, args.arch, args.dtype)
            print(f"wrote {args.output}/config.json and model.safetensors in {time.time() - t0:.2f} s")
        else:
            if args.cmd == "from-hf":
                (config, tokenizer), it = from_hf(args.hf, args.save, args.iteration, args.dtype), args.iteration
            else:
                config, tokenizer, it = from_megatron(args.load, args.save, args.iteration, args.vocab_size,
                                                      args.dtype)
            print(f"wrote {schema.iteration_dir(args.save, it)} in {time.time() - t0:.2f} s; "
                  f"train it with: --load {args.save} {pretrain_flags(config, tokenizer)}")
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # a damaged input
        print(f"convert_checkpoint.py {args.cmd}: error: {describe(e)} [a damaged or truncated input file? "
              "MEGAZERO_DEBUG=1 for the traceback]", file=sys.stderr)
        if debug_requested():
            raise
        return 1
    return 0


def check_outputs(args) -> None:
    """Before reading anything: the output is not inside a checkpoint, and replaces nothing
    without ``--overwrite``; an import's ``--save`` is a new or empty folder."""
    if args.cmd in ("to-fp32", "to-hf"):
        check_output(args.output, "--output", args.overwrite, folder=args.cmd == "to-hf")
        return
    check_output(args.save, "--save", True, folder=True)  # inside a checkpoint: refused
    if os.path.exists(args.save) and (not os.path.isdir(args.save) or os.listdir(args.save)):
        raise CheckpointError(f"--save {args.save} is not an empty folder: importing there would move a "
                              "run's pointer to this checkpoint (its later iterations overwritten); "
                              "choose a new folder")


if __name__ == "__main__":
    sys.exit(main())
