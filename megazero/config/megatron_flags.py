"""Megatron-LM's flags that megazero does not implement: accepted (class 2) or refused (class 3).

Every flag of Megatron-LM's GPT training path is a row of ``megatron_flags.tsv`` beside this
module (a data file, read once at import; its header says where the rows come from) with one of
three classes (docs/megatron.md lists them):

1. *honoured*: registered by :mod:`megazero.arguments` with Megatron's meaning (a few by
   :data:`HONOURED_FLAGS` here);
2. *no effect here, harmless* (kernel and fusion toggles, profiling, data-loader mechanics):
   parsed and dropped; :func:`take_compat_flags` returns them for one rank-0 start-up line;
3. *changes training, not available* (fp8, context parallelism, MoE, ...): an error before any
   process group, naming every such flag with what to do instead -- but only when its value
   differs from Megatron's default (``--context-parallel-size 1`` is what megazero trains).

Class 2 and 3 flags are registered with ``default=SUPPRESS`` under the dest ``megatron:<dest>``,
so only the flags a command line gives reach the namespace; :func:`take_compat_flags` removes them.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
from dataclasses import dataclass

from megazero.config.rank import current_rank

PREFIX = "megatron:"


@dataclass(frozen=True)
class MegatronFlag:
    options: tuple[str, ...]
    dest: str
    arity: str      # "0" switch, "1" value, "+"/"*" list, "N" N values
    default: object  # Megatron's default (a Python value)
    cls: int
    note: str

    @property
    def name(self) -> str:
        return self.options[0]


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def read_table(path: pathlib.Path) -> tuple[MegatronFlag, ...]:
    """The rows of a flag table file (``#`` lines are its header), in file order."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        cells = line.split("\t")
        if len(cells) != 6:
            raise ValueError(f"{path}:{number}: expected 6 tab-separated cells, found {len(cells)}")
        options, dest, arity, default, cls, note = cells
        rows.append(MegatronFlag(tuple(options.split(",")), dest, arity, _literal(default), int(cls), note))
    return tuple(rows)


TABLE = read_table(pathlib.Path(__file__).with_name("megatron_flags.tsv"))  # immutable, read once


def megatron_flags() -> tuple[MegatronFlag, ...]:
    """The table's rows, in Megatron's group order."""
    return TABLE


# Class 1 flags whose meaning lives outside megazero.arguments (training/logger.py, zero/norms.py,
# zero/param_sync.py, data/samplers.py): registered by add_compat_flags unless arguments.py has them.
HONOURED_FLAGS = (
    ("--log-params-norm", dict(action="store_true", help="'params norm' in the log line and TensorBoard")),
    ("--log-num-zeros-in-grad", dict(action="store_true", help="'num zeros' in the log line and TensorBoard")),
    ("--wandb-project", dict(default=None, help="also send the TensorBoard scalars to this W&B project "
                                                "(needs the wandb package; else one rank-0 line)")),
    ("--wandb-exp-name", dict(default=None, help="the W&B run name")),
    ("--wandb-save-dir", dict(default=None, help="the W&B run folder (default <--save>/wandb)")),
    ("--wandb-entity", dict(default=None, help="the W&B entity")),
    ("--overlap-param-gather", dict(action="store_true", help="ZeRO 1/2 parameter all-gather overlapped with the "
                                                              "next forward (megazero's default, --zero-overlap-comm)")),
    ("--no-gradient-accumulation-fusion", dict(action="store_false", dest="gradient_accumulation_fusion",
                                                help="the vocabulary matrices' weight gradients computed in the "
                                                     "parameter dtype, then added to the fp32 gradient")),
    ("--num-workers", dict(type=int, default=2, help="0: micro-batches read on the main thread; >= 1: one background "
                                                     "thread reads and pins the next iteration's (same samples)")),
)


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    """Register :data:`HONOURED_FLAGS` and the class 2 and 3 flags that ``parser`` does not already
    have."""
    known = {opt for action in parser._actions for opt in action.option_strings}
    honoured = parser.add_argument_group("Megatron-LM flags honoured (logging, overlap, data loading)")
    for name, kwargs in HONOURED_FLAGS:
        if name not in known:
            honoured.add_argument(name, **kwargs)
            known.add(name)
    groups = {2: parser.add_argument_group("Megatron-LM flags with no effect here (accepted; named at start-up)"),
              3: parser.add_argument_group("Megatron-LM flags not available here (an error unless Megatron's "
                                           "default; docs/megatron.md says what to use instead)")}
    for flag in megatron_flags():
        options = [o for o in flag.options if o not in known]
        if flag.cls == 1 or not options:
            continue
        kwargs = dict(dest=PREFIX + flag.dest, default=argparse.SUPPRESS, help=flag.note)
        if flag.arity == "0":
            kwargs.update(action="store_true")
        elif flag.arity != "1":
            kwargs.update(nargs=int(flag.arity) if flag.arity.isdigit() else flag.arity)
        groups[flag.cls].add_argument(*options, **kwargs)


def _unquote(value: str) -> str:
    return value.strip().strip("'\"") if isinstance(value, str) else value


def is_default(flag: MegatronFlag, value) -> bool:
    """Whether a given value equals Megatron's default (then even a class 3 flag changes nothing)."""
    default = flag.default
    if flag.arity == "0":
        return value is False  # a switch given on the command line is never Megatron's default
    if isinstance(value, list):
        value = [_unquote(v) for v in value]
        defaults = list(default) if isinstance(default, (list, tuple)) else [default]
        return [str(d) for d in defaults] == value
    value = _unquote(value)
    if default is None:
        return value.lower() == "none"
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == str(default)


def take_compat_flags(args) -> tuple[list[str], list[tuple[MegatronFlag, object]]]:
    """Remove the class 2/3 flags from ``args``: (class-2 flag names given, [(class-3 flag, value)]
    for those set to something other than Megatron's default)."""
    by_dest = {PREFIX + f.dest: f for f in megatron_flags() if f.cls != 1}
    harmless, unavailable = [], []
    for dest in [d for d in vars(args) if d.startswith(PREFIX)]:
        value = vars(args).pop(dest)
        flag = by_dest[dest]
        if flag.cls == 2:
            harmless.append(flag.name)
        elif not is_default(flag, value):
            unavailable.append((flag, value))
    return harmless, unavailable


def unavailable_message(unavailable: list[tuple[MegatronFlag, object]]) -> str:
    """One line naming every refused flag, grouped by what to do instead."""
    by_note: dict[str, list[str]] = {}
    for flag, value in unavailable:
        shown = flag.name if flag.arity == "0" else (
            f"{flag.name} {' '.join(map(str, value)) if isinstance(value, list) else value}")
        by_note.setdefault(flag.note, []).append(shown)
    parts = [f"{', '.join(names)} ({note})" for note, names in by_note.items()]
    return "Megatron-LM flags that change training and are not available in megazero: " + "; ".join(parts)


def harmless_line(names: list[str]) -> str:
    return ("> Megatron-LM flags with no effect here (same numbers; docs/megatron.md): "
            + ", ".join(sorted(set(names))))


def apply_megatron_flags(args, fail) -> None:
    """The class 2/3 flags: one rank-0 line for the harmless ones, one error naming every
    unavailable one (Megatron's aliases of megazero's flags: :func:`megazero.config.checks.resolve_aliases`)."""
    harmless, unavailable = take_compat_flags(args)
    if unavailable:
        fail(unavailable_message(unavailable))
    args.megatron_no_effect = tuple(sorted(set(harmless)))
    if harmless and current_rank() == 0:
        print(harmless_line(harmless), flush=True)


def markdown_table(honoured_notes: dict[str, str] | None = None) -> str:
    """The docs/megatron.md table: flag, class, what it does here, checked against the real
    library (:mod:`megazero.config.megatron_peer_checked`)."""
    from megazero.config.megatron_peer_checked import peer_checked
    names = {1: "honoured", 2: "no effect here", 3: "not available (error)"}
    lines = ["| flag | class | here | checked against the real library |", "|---|---|---|---|"]
    for flag in megatron_flags():
        note = (honoured_notes or {}).get(flag.name, flag.note)
        checked = next((peer_checked(o) for o in flag.options if peer_checked(o) != peer_checked("")),
                       peer_checked(""))
        lines.append(f"| `{' / '.join(flag.options)}` | {names[flag.cls]} | {note.replace('|', '/')} | {checked} |")
    return "\n".join(lines)
