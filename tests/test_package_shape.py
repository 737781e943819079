"""The package's seams, checked on its source: no module reaches into another module's private
names, and the generic parallel packages import no model, checkpoint or training code."""

from __future__ import annotations

import ast
import pathlib

from tests.package_walk import ROOT, SOURCES, imports, imports_of_source, module_name, private, private_defs


def test_no_module_imports_another_modules_private_names():
    bad = [f"{p.relative_to(ROOT)}:{line}: from {mod} import {name}"
           for p in SOURCES for mod, name, line in imports(p)
           if mod.startswith("megazero") and name is not None and private(name)
           and mod != module_name(p)]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_module_calls_another_modules_private_functions():
    """``obj._helper(...)`` where ``_helper`` is defined only in other megazero modules."""
    defs, bad = private_defs(), []
    for path in SOURCES:
        here = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in defs):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if here not in defs[node.attr]:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr} (defined in "
                           f"{', '.join(sorted(defs[node.attr]))})")
    assert not bad, "private functions used across modules:\n" + "\n".join(bad)


def test_pipeline_and_zero_know_no_model():
    """Model-specific things reach pipeline/ and zero/ as arguments (docs/INTERFACES.md)."""
    forbidden = ("megazero.model", "megazero.checkpoint", "megazero.training", "megazero.config")
    bad = []
    for package in ("pipeline", "zero", "parallel", "tensor_parallel"):
        for path in (ROOT / "megazero" / package).rglob("*.py"):
            bad += [f"{path.relative_to(ROOT)}:{line}: {mod}" for mod, _, line in imports(path)
                    if mod.startswith(forbidden)]
    assert not bad, "generic packages importing model/checkpoint/training code:\n" + "\n".join(bad)


def test_the_walker_resolves_absolute_and_relativeimports():
    """The walker itself works: a crafted module's private imports are found and resolved."""
    source = "from megazero.checkpoint.files import _atomic_write_text\nfrom .planner import _fmt\nimport torch\n"
    found = list(imports_of_source(source, "megazero.probe"))
    assert ("megazero.checkpoint.files", "_atomic_write_text", 1) in found
    assert ("megazero.planner", "_fmt", 2) in found and ("torch", None, 3) in found


# ---- the flags wing (docs/INTERFACES.md, "Arguments and configs") ----------------------------
ARGUMENTS_PACKAGE = (ROOT / "megazero" / "arguments.py", ROOT / "megazero" / "config")
# Command-line front ends that parse the training flags for their own purpose (the planner tries
# layouts for them); they read their own namespace and start no run.
OWN_COMMAND_LINE = (ROOT / "megazero" / "planner" / "cli.py",)


def _in_arguments_package(path: pathlib.Path) -> bool:
    return path == ARGUMENTS_PACKAGE[0] or ARGUMENTS_PACKAGE[1] in path.parents


def _namespace_reads(tree: ast.AST, allowed_function: str | None = None):
    """(line, what) of every ``args.X`` attribute and ``getattr(args, ...)`` outside the function
    named ``allowed_function``."""
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == allowed_function:
            allowed |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            yield node.lineno, f"args.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
            yield node.lineno, "getattr(args, ...)"


def test_only_the_arguments_package_and_build_configs_read_the_namespace():
    """Everything else takes its typed config (megazero.config.configs)."""
    bad = []
    for path in sorted([*(ROOT / "megazero").rglob("*.py"), ROOT / "pretrain_gpt.py"]):
        if _in_arguments_package(path) or path in OWN_COMMAND_LINE:
            continue
        allowed = "build_configs" if path == ROOT / "megazero" / "training" / "build.py" else None
        bad += [f"{path.relative_to(ROOT)}:{line}: {what}"
                for line, what in _namespace_reads(ast.parse(path.read_text()), allowed)]
    assert not bad, "argument namespace read outside the arguments package:\n" + "\n".join(bad)


def test_the_namespace_walker_finds_reads():
    tree = ast.parse("def build_configs(args):\n    return args.lr\n"
                     "def other(args):\n    return args.seed, getattr(args, 'x', 1)\n")
    assert [w for _, w in _namespace_reads(tree, "build_configs")] == ["args.seed", "getattr(args, ...)"]


# The planner's formulas are pure arithmetic on a GPTConfig (the flags check a layout's memory with
# them); the rest of the planner (its command line, timing, tables) parses flags itself.
PLANNER_FORMULAS = ("megazero.planner.memory", "megazero.planner.cp_memory", "megazero.planner.expert_memory")


def test_the_arguments_package_imports_no_training_checkpoint_or_planner_code():
    forbidden = ("megazero.training", "megazero.checkpoint", "megazero.planner", "megazero.inference",
                 "megazero.engine", "megazero.zero", "megazero.pipeline")
    paths = [ARGUMENTS_PACKAGE[0], *ARGUMENTS_PACKAGE[1].rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in paths for mod, name, line in imports(p)
           if (mod.startswith(forbidden) and mod not in PLANNER_FORMULAS)
           or (mod == "megazero" and name in ("training", "checkpoint", "planner"))]
    assert not bad, "the arguments package reaching into later packages:\n" + "\n".join(bad)


def test_the_arguments_package_reaches_no_process_group_code():
    """Of ``megazero.parallel`` the flags may use only the layout arithmetic (``parallel/layout.py``,
    which imports no ``torch.distributed``); which rank prints is ``config/rank.py``'s."""
    paths = [ARGUMENTS_PACKAGE[0], *ARGUMENTS_PACKAGE[1].rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in paths for mod, name, line in imports(p)
           if mod.startswith("megazero.parallel") and mod != "megazero.parallel.layout"
           or (mod == "megazero.parallel" and name != "layout")]
    layout = ROOT / "megazero" / "parallel" / "layout.py"
    bad += [f"parallel/layout.py:{line}: {mod}" for mod, _, line in imports(layout)
            if mod.startswith("torch.distributed") or mod.startswith("megazero")]
    assert not bad, "the arguments package reaching process-group code:\n" + "\n".join(bad)


def test_few_top_level_modules_and_no_long_files():
    top = sorted(p.name for p in (ROOT / "megazero").glob("*.py"))
    assert len(top) <= 6, f"megazero/ has {len(top)} top-level modules: {top}"
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in SOURCES
            if (n := len(p.read_text().splitlines())) > 330]
    assert not long, "files over 330 lines:\n" + "\n".join(long)
