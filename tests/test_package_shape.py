"""The package's seams, checked on its source: no module reaches into another module's private
names, and the generic parallel packages import no model, checkpoint or training code."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "megazero").rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "bench").glob("*.py"),
                  ROOT / "pretrain_gpt.py"])


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(path: pathlib.Path):
    """(imported module, imported name or None, line) of every import in ``path``."""
    return _imports_of_source(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_of_source(source: str, module: str, is_package: bool = False):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node, is_package)
            for alias in node.names:
                yield target, alias.name, node.lineno


def _private_defs() -> dict[str, set[str]]:
    """Private function/method names defined in megazero, with the modules defining them."""
    defs: dict[str, set[str]] = {}
    for path in (ROOT / "megazero").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                defs.setdefault(node.name, set()).add(_module_name(path))
    return defs


def test_no_module_imports_another_modules_private_names():
    bad = [f"{p.relative_to(ROOT)}:{line}: from {mod} import {name}"
           for p in SOURCES for mod, name, line in _imports(p)
           if mod.startswith("megazero") and name is not None and _private(name)
           and mod != _module_name(p)]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_module_calls_another_modules_private_functions():
    """``obj._helper(...)`` where ``_helper`` is defined only in other megazero modules."""
    defs, bad = _private_defs(), []
    for path in SOURCES:
        here = _module_name(path)
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
            bad += [f"{path.relative_to(ROOT)}:{line}: {mod}" for mod, _, line in _imports(path)
                    if mod.startswith(forbidden)]
    assert not bad, "generic packages importing model/checkpoint/training code:\n" + "\n".join(bad)


def test_the_walker_resolves_absolute_and_relative_imports():
    """The walker itself works: a crafted module's private imports are found and resolved."""
    source = "from megazero.checkpoint.files import _atomic_write_text\nfrom .planner import _fmt\nimport torch\n"
    found = list(_imports_of_source(source, "megazero.probe"))
    assert ("megazero.checkpoint.files", "_atomic_write_text", 1) in found
    assert ("megazero.planner", "_fmt", 2) in found and ("torch", None, 3) in found
