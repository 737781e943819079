"""The door: every command-line flag (Megatron-LM's names and meanings), validated and derived.

The flags wing lives behind it in :mod:`megazero.config`: the flag groups, Megatron's flag table,
the DeepSpeed config reader, the checks and the typed configs. ``parse_args(argv)`` parses,
resolves Megatron's aliases (:func:`megazero.config.checks.resolve_aliases`), merges an optional
DeepSpeed JSON config (``--deepspeed-config``, read as DeepSpeed reads it by
:mod:`megazero.config.deepspeed_config`), validates and derives, all before any process group
exists. Invalid input exits with status 2 and one ``prog: error: A; B; ...`` line that names the
flags, paths and numbers of every problem found, printed by global rank 0 only (every rank exits
with status 2). Problems worth a warning are Python warnings here; ``pretrain_gpt.py`` prints them
as one ``WARNING: ...`` line each, by rank 0 only (:func:`megazero.config.failures.warnings_as_lines`). Nothing here has side effects beyond reading
the config file (and ``--data-args-path``).

Derived values, computed only in :func:`megazero.config.checks.derive` (called by ``parse_args``):

* ``world_size``                      -- from ``WORLD_SIZE`` / ``SLURM_NTASKS`` (default 1)
* ``data_parallel_size``              -- ``world / (TP * PP)``
* ``num_micro_batches``               -- ``global_batch / (micro_batch * DP)``
* ``virtual_pipeline_model_parallel_size`` -- ``num_layers / (PP * layers_per_virtual_stage)``
* ``lr_decay_iters``                  -- ``train_iters`` unless given
* ``params_dtype``                    -- ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``
* ``expert_tensor_parallel_size``     -- ``tensor_model_parallel_size`` unless given (Megatron's default)

The model's own derived sizes (FFN size, head size, query groups, the padded vocabulary) are
not written here: :class:`megazero.model.GPTConfig` derives them, once, when the run's configs
are built (``megazero.training.build.build_configs``), after the tokenizer has given the
vocabulary size. Nothing but that function and this package reads the namespace: the rest of
megazero takes the typed configs of :mod:`megazero.config.configs`.

``parse_args`` returns :class:`Arguments`, frozen once validated: assigning to it raises, so no
later step can change what the flags said (use :meth:`Arguments.replace` for a modified copy).
"""

from __future__ import annotations

import argparse
import os
import sys

from megazero.config.checkpoint_args import apply_checkpoint_args
from megazero.config.checks import derive, report, resolve_aliases, validate
from megazero.config.deepspeed_config import apply_deepspeed_config
from megazero.config.flags import build_parser
from megazero.config.megatron_flags import apply_megatron_flags
from megazero.config.path_checks import PATH_CHECKS
from megazero.config.run_checks import early_problems

__all__ = ["Arguments", "build_parser", "parse_args"]



class Arguments(argparse.Namespace):
    """The parsed flags; read-only after :func:`parse_args` validated them."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"arguments are frozen after validation; cannot set {name!r} "
                                 "(build a config object, or use args.replace(...) for a copy)")
        super().__setattr__(name, value)

    def freeze(self) -> "Arguments":
        self.__dict__["_frozen"] = True
        return self

    def replace(self, **changes) -> "Arguments":
        """A frozen copy with ``changes`` applied (no re-validation)."""
        values = {k: v for k, v in vars(self).items() if k != "_frozen"}
        values.update(changes)
        return Arguments(**values).freeze()

    def as_dict(self) -> dict:
        """The flags' values by ``dest`` name."""
        return {k: v for k, v in vars(self).items() if k != "_frozen"}


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Dests of the flags that appear literally in ``argv`` (abbreviations are disabled)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    dests = set()
    for action in parser._actions:
        if any(opt in given for opt in action.option_strings):
            dests.add(action.dest)
    return dests


def world_size_from_env(env=os.environ) -> int:
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key):
            return int(env[key])
    return 1


def parse_args(argv: list[str] | None = None, world_size: int | None = None, prog: str | None = None,
               training: bool = False, checks=(), read_saved=None):
    """Parse, merge ``--deepspeed-config``, validate and derive. Exits with status 2 and one line
    listing every problem found on bad input. ``training`` (``pretrain_gpt.py``): also require
    what a training run needs (sizes, the length of the run, ``--lr``, data) and check the paths
    it names (:mod:`megazero.config.path_checks`), as Megatron's validation does. ``checks``: further
    ``check(err, args)`` run on the valid, derived values (``pretrain_gpt.py``: free space for one
    checkpoint, which needs the model's size); their problems are listed the same way.
    ``read_saved``: how ``--use-checkpoint-args`` reads a Megatron-LM torch_dist folder's arguments
    (:mod:`megazero.config.checkpoint_args`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv, namespace=Arguments())
    args.world_size = world_size if world_size is not None else world_size_from_env()
    problems = []
    apply_checkpoint_args(args, problems.append, read_saved)  # before every check, as Megatron-LM
    problems += early_problems(args)
    apply_megatron_flags(args, problems.append)
    resolve_aliases(args)
    if args.deepspeed_config:
        apply_deepspeed_config(parser, args, explicit_dests(parser, argv))
    validate(parser, args, training=training, extra_checks=PATH_CHECKS if training else (), problems=problems)
    derive(args)
    late = []
    for check in checks:
        check(late.append, args)
    report(parser, late)
    return args.freeze()
