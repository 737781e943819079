#!/usr/bin/env python
"""Generate text from a megazero checkpoint with tensor parallelism and a KV cache.

    torchrun --nproc-per-node 2 tools/generate.py --load runs/demo/checkpoints \\
        --tensor-model-parallel-size 2 --prompt "In the beginning" --max-new-tokens 40
    torchrun --nproc-per-node 4 tools/generate.py --load mixtral_ckpt --tensor-model-parallel-size 2 \\
        --expert-model-parallel-size 2 --prompt "In the beginning"
    python tools/generate.py --load DIR --prompt-file prompts.txt --top-k 40 --temperature 0.8

The checkpoint may come from any training layout (TP, PP, VP, DP, ZeRO stage, dtype): its full,
unpadded weights are read (:class:`megazero.checkpoint.reader.CheckpointReader`) and sliced for
this run's TP size (the vocabulary re-padded for it). The model is one pipeline stage without
sequence parallelism or dropout. An MoE model's experts may be spread over
``--expert-model-parallel-size`` ranks (each weight split over ``--expert-tensor-parallel-size``,
default TP): the run then takes lcm(TP, ETP x EP) ranks, the expert grid carved out of TP x DP as
in training, every rank with the same prompts and the tokens agreed over all of them. The tokenizer comes from the saved arguments (an imported model's is
in ``DIR/tokenizer/``); ``--tokenizer-type`` replaces it and ``--tokenizer-model``, ``--vocab-file``,
``--merge-file`` override paths. With ``--tokenizer-type NullTokenizer`` (``--vocab-size``, default
the model's vocabulary) prompts and completions are whitespace-separated token ids. Prompts (``--prompt``, repeatable, and/or
``--prompt-file``, one per line) run in batches of ``--batch-size`` rows, left-padded.

Decoding (:mod:`megazero.inference.generation`): greedy by default; ``--temperature``, ``--top-k``,
``--top-p`` switch to sampling from a generator seeded by ``--seed`` on the all-gathered logits,
identical on all TP ranks. Rows stop at the tokenizer's eod; a batch stops when every row has,
or after ``--max-new-tokens``. Rank 0 prints each completion and the tokens/s.

An empty prompt starts from the tokenizer's BOS (else EOD) token, as ``transformers`` does, and
says so. A bad input (a missing ``--load`` folder, an iteration it does not hold, ``--top-k -5``,
``--temperature inf``, a prompt longer than the model's positions, an empty prompt with neither
token, an unreadable ``--prompt-file``) ends with one ``generate.py: error: ...`` line, exit status
1 (2 for flags); ``--debug`` or ``MEGAZERO_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.checkpoint import CheckpointError  # noqa: E402
from megazero.config.failures import debug_requested, describe  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402
from megazero.inference.generation import generate  # noqa: E402
from megazero.inference.latent_cache import cache_note  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a text file, one prompt per line")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without sampling flags)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    args = p.parse_args(argv)
    _check_values(p, args)
    sampling = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    if args.greedy and sampling:
        p.error("--greedy excludes --temperature / --top-k / --top-p")
    args.greedy = args.greedy or not sampling
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.top_k = args.top_k or 0
    args.top_p = 1.0 if args.top_p is None else args.top_p
    if args.prompt_file:
        try:
            with open(args.prompt_file) as f:
                args.prompt += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--prompt-file {args.prompt_file}: {(getattr(e, 'strerror', None) or str(e)).lower()}")
    if not args.prompt:
        p.error("give --prompt and/or --prompt-file")
    return args


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint, parallel layout, dtype and tokenizer flags (shared with
    ``run_text_generation_server.py``)."""
    p.add_argument("--load", required=True, help="checkpoint folder (holds latest_checkpointed_iteration.txt)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to load (default: the latest)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1, help="MoE: ranks the experts are spread over")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="MoE: ranks each expert's weights are split over (default: TP)")
    p.add_argument("--params-dtype", choices=["fp32", "bf16", "fp16", "saved"], default="fp32",
                   help="weights' dtype for generation (default fp32: fastest on CPU)")
    p.add_argument("--tokenizer-type", default=None,
                   help="override the checkpoint's recorded tokenizer (Megatron's names, as pretrain_gpt.py)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (default: the model's); prompts are then ids, e.g. '5 17 3'")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"])
    p.add_argument("--debug", action="store_true", help="print the traceback of a failure (also MEGAZERO_DEBUG=1)")


def _check_values(p: argparse.ArgumentParser, args) -> None:
    """Sampling settings and sizes in range, named by their flags (``p.error``: status 2); a NaN fails
    every test, and ``--temperature inf`` (``z / inf`` = 0: uniform draws) is refused by name."""
    problems = [f"{flag} must be {rule}, got {value}" for flag, value, ok, rule in (
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 0, ">= 0 (0: no top-k filter)"),
        ("--top-p", args.top_p, args.top_p is None or 0.0 < args.top_p <= 1.0, "in (0, 1]"),
        ("--temperature", args.temperature, args.temperature is None or 0 < args.temperature < math.inf,
         "finite and > 0 (or --greedy)"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, ">= 0"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size, args.tensor_model_parallel_size >= 1, ">= 1"),
        ("--expert-model-parallel-size", args.expert_model_parallel_size, args.expert_model_parallel_size >= 1, ">= 1"),
        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size,
         args.expert_tensor_parallel_size is None or args.expert_tensor_parallel_size >= 1, ">= 1"),
    ) if not ok]
    if problems:
        p.error("; ".join(problems))


def check_load(load_dir: str, iteration: int | None) -> None:
    """``--load`` is a folder holding a checkpoint, and ``--iteration`` one of its iterations."""
    from megazero.checkpoint.schema import LATEST, iteration_dir, saved_iterations
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: {'not a folder' if os.path.exists(load_dir) else 'no such folder'}")
    if iteration is not None and not os.path.isdir(iteration_dir(load_dir, iteration)):
        saved = saved_iterations(load_dir)
        raise CheckpointError(f"--load {load_dir} holds no iteration {iteration} (saved: "
                              f"{', '.join(map(str, saved)) or 'none'}; {LATEST} names the latest)")


def check_prompts(ids: list[list[int]], texts: list[str], limit: int, start: int) -> None:
    """Every prompt fits the model's ``limit`` positions (the learned position table, or the
    sequence length a rope model was trained at)."""
    for i, (row, text) in enumerate(zip(ids, texts)):
        if len(row) > limit:
            raise ValueError(f"prompt {start + i + 1} ({text[:30]!r}...) has {len(row)} tokens; the model takes at "
                             f"most {limit} positions (max_position_embeddings): shorten it")


def build_topology(tp: int, backend: str | None, ep: int = 1, etp: int | None = None):
    """(topology or None, device): joins torchrun's process group (or the caller's) when world > 1.
    The world is lcm(TP, ETP x EP) ranks: TP alone for a dense model (see the module doc)."""
    from megazero.parallel.launch import init_distributed
    from megazero.parallel.topology import Topology
    world = math.lcm(tp, (tp if etp is None else etp) * ep)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if world != 1:
            raise SystemExit(f"--tensor-model-parallel-size {tp} --expert-model-parallel-size {ep} needs torchrun "
                             f"--nproc-per-node {world}")
        return None, torch.device("cpu")
    launch, device = init_distributed(backend)
    if launch.world_size != world:
        what = "TP" if world == tp else f"lcm(TP {tp}, ETP {etp or tp} x EP {ep})"
        raise SystemExit(f"generation runs on exactly {what} = {world} ranks: world size {launch.world_size}")
    return Topology(launch.world_size, launch.rank, tp=tp, ep=ep, etp=etp).create_groups(), device


def load_model(load_dir: str, topo, device, iteration=None, params_dtype: str = "fp32"):
    """(model, reader): a single-stage GPTModel at ``topo``'s TP size with the checkpoint's weights.

    ``reader.args`` are the saving run's arguments, ``reader.layout`` its parallel layout."""
    from megazero.checkpoint.reader import CheckpointReader
    from megazero.checkpoint.reshard import load_buffers
    reader = CheckpointReader(load_dir, iteration)
    dtype = None if params_dtype == "saved" else DTYPES[params_dtype]
    overrides = dict(sequence_parallel=False, recompute_granularity=None, attention_dropout=0.0, hidden_dropout=0.0)
    if dtype is not None:
        overrides["params_dtype"] = dtype
    config = GPTConfig.from_saved_args(reader.args, **overrides)
    model = GPTModel(config, topo, device=device).eval()
    wanted, loaded = {name for name, _ in model.named_parameters()}, set()
    for name, full in reader.iter_full_params(dtype=config.params_dtype):  # one full tensor at a time
        loaded |= wanted - set(model.load_full_state_dict({name: full}, strict=False))
    load_buffers(reader, [model])  # an MoE router's expert bias (the routing depends on it)
    reader.close()
    if wanted - loaded:
        raise KeyError(f"{load_dir}: the checkpoint lacks {sorted(wanted - loaded)}")
    return model, reader


def build_tokenizer_from(saved: dict, args, load_dir: str):
    """The tokenizer: the checkpoint's recorded one (paths relative to ``load_dir`` resolved, see
    ``saved_tokenizer_flags``), or ``--tokenizer-type``; explicit file flags override paths."""
    from megazero.data.tokenizers import TokenizerConfig, build_tokenizer, saved_tokenizer_flags
    t = saved_tokenizer_flags(saved, load_dir)
    if args.tokenizer_type is not None and args.tokenizer_type != t.get("tokenizer_type"):
        t = {"tokenizer_type": args.tokenizer_type}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, key) is not None:
            t[key] = getattr(args, key)
    if not t.get("tokenizer_type"):
        raise SystemExit(f"{load_dir}: the checkpoint records no tokenizer; pass --tokenizer-type (and its "
                         "files), or --tokenizer-type NullTokenizer to give prompts as ids")
    t["vocab_size"] = args.vocab_size if args.vocab_size is not None else saved.get("vocab_size")
    return build_tokenizer(TokenizerConfig.from_flags(t))


def main(argv=None) -> list[str]:
    """Run generation; returns the completions (every rank) and prints them on rank 0. A failure
    raises ``SystemExit("generate.py: error: ...")`` (one line, status 1) unless debugging."""
    args = parse_args(argv)
    try:
        return run(args)
    except (CheckpointError, OSError, ValueError, KeyError, RuntimeError) as e:
        if debug_requested(args.debug):
            raise
        plain = isinstance(e, (CheckpointError, ValueError))  # worded here: the flag, the file, the numbers
        raise SystemExit(f"generate.py: error: {e if plain else describe(e)}") from None


def load_for_generation(args):
    """(topo, model, tokenizer, agree group): join the ranks, load ``--load`` at this TP size and
    build its tokenizer; rank 0 prints what was loaded. Shared with the REST server."""
    topo, device = build_topology(args.tensor_model_parallel_size, args.distributed_backend,
                                  args.expert_model_parallel_size, args.expert_tensor_parallel_size)
    agree = dist.group.WORLD if topo is not None and topo.world_size > topo.tp else None  # EP: every rank
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    check_load(args.load, args.iteration)
    model, reader = load_model(args.load, topo, device, args.iteration, args.params_dtype)
    tok = build_tokenizer_from(reader.args, args, args.load)
    if topo is None or topo.rank == 0:
        c, lay = model.config, reader.layout
        print(f"> loaded {args.load} iteration {reader.iteration} (trained with TP "
              f"{lay.get('tensor_model_parallel_size')} PP {lay.get('pipeline_model_parallel_size')} "
              f"VP {lay.get('virtual_pipeline_model_parallel_size')} DP {lay.get('data_parallel_size')} "
              f"ZeRO {lay.get('zero_stage')}, {lay.get('params_dtype')}) into TP {args.tensor_model_parallel_size}"
              f"{f' EP {args.expert_model_parallel_size}' if args.expert_model_parallel_size > 1 else ''}, "
              f"{c.params_dtype}: {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
        if cache_note(c):
            print(cache_note(c), flush=True)
    return topo, model, tok, agree


def tokenize_prompts(tok, texts: list[str], start: int) -> tuple[list[list[int]], list[str]]:
    """(token ids of each prompt, note lines). A prompt with no tokens (``--prompt ""``) starts from
    the tokenizer's BOS, else its EOD (GPT-2's ``<|endoftext|>`` is both; a sentencepiece id -1 is
    none), as ``transformers``' ``generate()`` starts from ``bos_token_id`` given no ``input_ids``
    and raises without one: a note line per such prompt; ValueError naming it with neither token."""
    starts = [(n.upper(), t) for n in ("bos", "eod") if isinstance(t := getattr(tok, n, None), int) and t >= 0]
    ids, notes = [], []
    for i, text in enumerate(texts):
        ids.append(tok.tokenize(text))
        if not ids[-1] and not starts:
            raise ValueError(f"prompt {start + i + 1} ({text!r}) has no tokens and the tokenizer has no BOS or EOD "
                             "token to start from: give it some text")
        if not ids[-1]:
            ids[-1] = [starts[0][1]]
            notes.append(f"> prompt {start + i + 1} ({text!r}) has no tokens: generating from the tokenizer's "
                         f"{starts[0][0]} token (id {starts[0][1]}), as transformers does without input_ids")
    return ids, notes


def completion_text(tok, prompt_ids: list[int], row: list[int], eod) -> tuple[str, str]:
    """(prompt + completion, completion) text of a generated ``row`` (its final eod dropped)."""
    body = row[:-1] if row and row[-1] == eod else row
    full, head = tok.detokenize(prompt_ids + body), tok.detokenize(prompt_ids)
    return full, (full[len(head):] if full.startswith(head) else tok.detokenize(body))


def run(args) -> list[str]:
    """Generation for parsed ``args`` (see :func:`main`)."""
    topo, model, tok, agree = load_for_generation(args)
    rank0 = topo is None or topo.rank == 0
    eod = getattr(tok, "eod", None)
    completions, new_tokens, seconds = [], 0, 0.0
    for start in range(0, len(args.prompt), args.batch_size):
        texts = args.prompt[start:start + args.batch_size]
        ids, notes = tokenize_prompts(tok, texts, start)
        for note in notes if rank0 else ():
            print(note, flush=True)
        check_prompts(ids, texts, model.config.max_position_embeddings, start)
        res = generate(model, ids, args.max_new_tokens, eod=eod, greedy=args.greedy, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed + start, use_cache=not args.no_kv_cache,
                       group=agree)
        new_tokens += res.new_tokens
        seconds += res.prefill_s + res.decode_s
        for text, prompt_ids, row in zip(texts, ids, res.tokens):
            full, completion = completion_text(tok, prompt_ids, row, eod)
            completions.append(completion)
            if rank0:
                end = " <eod>" if row and row[-1] == eod else ""
                print(f"\n>>> {text}\n{full}{end}", flush=True)
    if rank0:
        mode = "greedy" if args.greedy else f"sampling (T={args.temperature}, top-k {args.top_k}, top-p {args.top_p})"
        print(f"\n> generated {new_tokens} tokens for {len(args.prompt)} prompt(s) in {seconds:.2f} s: "
              f"{new_tokens / max(seconds, 1e-9):.1f} tokens/s ({mode}, TP {args.tensor_model_parallel_size}, "
              f"{'no ' if args.no_kv_cache else ''}KV cache, batch <= {args.batch_size})", flush=True)
    return completions


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
