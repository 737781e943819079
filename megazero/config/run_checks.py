"""What a run's values must be, checked with the flags (:func:`megazero.config.checks.validate`):
precision, the tokenizer's name, the split, and what a training run cannot start without (Megatron asserts these in
``validate_args``). Each check is ``check(err, args)``; ``err`` records one problem."""

from __future__ import annotations

import os
import warnings

from megazero.config.batch_schedule import BatchSchedule
from megazero.config.cp_flags import model_parallel_product
from megazero.data.gpt_dataset import INDEX_BYTES_PER_SAMPLE, parse_split
from megazero.data.indexed_dataset import DataError
from megazero.config.path_checks import readable_file_problem

TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
              "HuggingFaceTokenizer", "NullTokenizer")  # = megazero.data.tokenizers.TOKENIZER_TYPES


def check_run(err, args) -> None:
    """Precision, ZeRO knobs, tokenizer, schedule; a --load folder that does not exist yet is
    Megatron's first run of a requeue script: a warning, then training starts from scratch."""
    if args.fp16 and args.bf16:
        err("--fp16 and --bf16 are mutually exclusive")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        err(f"--load {args.load} is not a directory")
    if args.tokenizer_type is not None and args.tokenizer_type not in TOKENIZERS:
        err(f"--tokenizer-type {args.tokenizer_type!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if args.data_path and args.split is not None:  # --split cuts a --data-path blend into train/valid/test
        try:
            parse_split(args.split)
        except DataError as e:
            err(str(e))


def check_required(err, args) -> None:
    """What a training run cannot start without (Megatron asserts these in validate_args): named
    here, never a TypeError later."""
    missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads",
                                                   "seq_length", "micro_batch_size") if getattr(args, n) is None]
    if missing:
        err(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    if args.train_iters is None and args.train_samples is None:
        err("one of --train-iters or --train-samples is required")
    if args.lr is None and not args.deepspeed_scheduler:
        err("--lr is required (or a --deepspeed-config optimizer/scheduler block)")
    if args.mock_data and args.vocab_size is None:
        err("--mock-data needs --vocab-size (the synthetic tokens' vocabulary)")
    if not (args.data_path or args.mock_data or args.train_data_path):
        err("no training data: give --data-path PREFIX (or --train-data-path ...), or --mock-data with "
            "--vocab-size for synthetic tokens (Megatron-LM requires --mock-data too)")
    if (args.data_path or args.train_data_path) and args.tokenizer_type is None and not args.load:
        err(f"--tokenizer-type is required to read {'--data-path' if args.data_path else '--train-data-path'} "
            f"(one of {', '.join(TOKENIZERS)}; NullTokenizer with --vocab-size for pre-tokenized ids)")
    if not (args.swiglu or args.openai_gelu) and args.add_bias_linear and getattr(args, "bias_gelu_fusion", True):
        warnings.warn("this GELU model with biases trains exact GELU; Megatron-LM's mcore GPT (megatron-core 0.16.1, "
                      "its default --bias-gelu-fusion) trains the tanh approximation: pass --openai-gelu for "
                      "Megatron's numbers, or --no-bias-gelu-fusion to say exact GELU is meant", stacklevel=5)
    if args.save_interval is not None and not args.save:
        warnings.warn(f"--save-interval {args.save_interval} without --save: no checkpoint will be written",
                      stacklevel=5)


def early_problems(args) -> list[str]:
    """Problems found before the checks of :mod:`megazero.config.checks`: an unreadable
    ``--data-args-path`` (then not read), a query-group count without its switch or vice versa."""
    problems = []
    if args.data_args_path and readable_file_problem("--data-args-path", args.data_args_path):
        problems.append(readable_file_problem("--data-args-path", args.data_args_path))
        args.data_args_path = None
    if args.group_query_attention and args.num_query_groups is None:
        problems.append("--group-query-attention needs --num-query-groups")
    if args.num_query_groups is not None and not args.group_query_attention:
        # Megatron-LM (core_transformer_config_from_args) ignores the group count without the switch
        problems.append(f"--num-query-groups {args.num_query_groups} needs --group-query-attention: without it "
                        "Megatron-LM ignores --num-query-groups and trains multi-head attention; add "
                        "--group-query-attention for GQA, or drop --num-query-groups")
    return problems


def host_memory_bytes() -> int | None:
    """This host's physical memory in bytes (``sysconf``), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_sample_counts(err, args, memory_bytes: int | None = None) -> None:
    """The samples a training run draws can be indexed. A dataset keeps at least
    ``INDEX_BYTES_PER_SAMPLE`` = 24 bytes of index per sample (``GPTDataset``: sample index and
    shuffle index, int64), built in one process's memory, so a count whose index alone exceeds
    this host's physical memory (``memory_bytes``, default :func:`host_memory_bytes`) can never
    be indexed: numpy would end it in ``MemoryError: Unable to allocate 4.72 TiB`` after the
    process groups start. Mock data is held to the same bound (what passes with ``--mock-data``
    must not fail on real data; a batch of 10^12 mock samples would not end either). The counts
    are ``training.data.sample_counts``': train ``--train-samples`` or ``--train-iters`` x B, raised
    to what a batch-size schedule consumes in those iterations; valid ``eval_iters`` x B per
    evaluation. The line names the flag(s) that set the count and the count."""
    limit = memory_bytes or host_memory_bytes()
    mbs, world, product = args.micro_batch_size, args.world_size, model_parallel_product(args)
    if not limit or not mbs or mbs < 1 or product < 1 or world % product:
        return  # no micro-batch or grid to count with: named by other checks
    most = limit // INDEX_BYTES_PER_SAMPLE

    def refuse(what: str, count: int, kind: str) -> None:
        err(f"{what} makes the run draw {count} {kind} samples, more than can be indexed: a dataset index "
            f"takes {INDEX_BYTES_PER_SAMPLE} bytes a sample ({count * INDEX_BYTES_PER_SAMPLE / 2**40:.3g} TiB), "
            f"this host has {limit / 2**30:.1f} GiB of memory (at most {most} samples): lower it")
    try:
        schedule = BatchSchedule.from_args(args, data_parallel_size=world // product)
    except ValueError:
        return  # a malformed schedule: named by the batch-schedule check
    batch, samples, iters = args.global_batch_size or mbs * (world // product), args.train_samples, args.train_iters
    if samples is not None and samples > most:
        return refuse(f"--train-samples {samples}", samples, "training")
    iters = schedule.train_iters(samples) if samples is not None else iters
    if iters is None:
        return
    drawn = max(samples if samples is not None else iters * batch, schedule.consumed_after(iters))
    if drawn > most:
        text, run = args.step_batch_size_schedule, (f"--train-samples {samples}" if samples is not None
                                                     else f"--train-iters {iters}")
        return refuse(f"--step-batch-size-schedule {text!r} with {run}" if text else f"{schedule.flag} with {run}"
                      if args.rampup_batch_size else f"{run} x --global-batch-size {batch}", drawn, "training")
    evals = iters // args.eval_interval + 1 if args.eval_interval else 0
    if evals * args.eval_iters * batch > most:
        refuse(f"--eval-iters {args.eval_iters} x {evals} evaluations (--eval-interval {args.eval_interval}) x "
               f"--global-batch-size {batch}", evals * args.eval_iters * batch, "validation")
