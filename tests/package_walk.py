"""The source walker of the package-shape tests: module names, their imports (module level and
inside functions alike), resolved to absolute names."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "megazero").rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "bench").glob("*.py"),
                  ROOT / "pretrain_gpt.py"])


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports(path: pathlib.Path):
    """(imported module, imported name or None, line) of every import in ``path``."""
    return imports_of_source(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of_source(source: str, module: str, is_package: bool = False):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = absolute(module, node, is_package)
            for alias in node.names:
                yield target, alias.name, node.lineno


def private_defs() -> dict[str, set[str]]:
    """Private function/method names defined in megazero, with the modules defining them."""
    defs: dict[str, set[str]] = {}
    for path in (ROOT / "megazero").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
                defs.setdefault(node.name, set()).add(module_name(path))
    return defs
