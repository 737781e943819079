"""One home per parallel dimension and per format (issue 40), checked on the source: which package
may import which, no import cycle between any files, every megazero checkpoint file written and
read under ``megazero/checkpoint/``, and ``model/`` holding models only."""

from __future__ import annotations

import ast

from tests.package_walk import ROOT, imports, module_name

HOMES = {  # a reader names these from the folder list alone
    "tensor parallelism": "tensor_parallel", "context parallelism": "context_parallel",
    "experts (MoE, EP)": "moe", "pipeline parallelism": "pipeline", "ZeRO": "zero",
    "checkpoints": "checkpoint", "conversion": "checkpoint/convert", "inference": "inference",
    "optimizers and LR schedules": "optim", "memory formulas": "planner", "models": "model",
}

# What each parallel dimension (and the optimizer math) may import from megazero: the layers below
# it only. None knows a training loop, a checkpoint file, a flag or a model.
ALLOWED = {
    "parallel": {"parallel"},
    "tensor_parallel": {"parallel", "tensor_parallel"},
    "context_parallel": {"parallel", "tensor_parallel", "context_parallel"},
    "moe": {"parallel", "tensor_parallel", "moe"},
    "pipeline": {"parallel", "pipeline"},
    "optim": {"optim", "config"},  # the LR schedules read their typed LRConfig
    "zero": {"parallel", "optim", "zero"},
    "model": {"parallel", "tensor_parallel", "context_parallel", "moe", "model"},
}
# Concerns with a home of their own: a module of model/ named like one of these is in the wrong room.
NOT_MODELS = ("hf", "megatron", "generation", "serving", "inference", "cache", "memory", "moe", "context_parallel",
              "cp_", "expert", "load_model", "checkpoint", "lr_schedule")


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _megazero_modules() -> dict:
    return {module_name(p): p for p in (ROOT / "megazero").rglob("*.py")}


def test_every_dimension_and_format_has_a_home():
    missing = [f"{what}: megazero/{home}/" for what, home in HOMES.items()
               if not (ROOT / "megazero" / home / "__init__.py").is_file()]
    assert not missing, "homes missing:\n" + "\n".join(missing)


def test_each_dimension_imports_only_what_is_below_it():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in (ROOT / "megazero" / package).rglob("*.py"):
            bad += [f"{path.relative_to(ROOT)}:{line}: {mod}" for mod, name, line in imports(path)
                    if mod.startswith("megazero") and _package_of(mod if mod != "megazero" else f"megazero.{name}")
                    not in allowed]
    assert not bad, "imports across homes against the flow:\n" + "\n".join(bad)


def test_model_holds_models_only():
    names = sorted(p.stem for p in (ROOT / "megazero" / "model").glob("*.py"))
    misplaced = [n for n in names if any(n.startswith(c) or c in n.split("_") for c in NOT_MODELS)]
    assert not misplaced, f"model/ holds modules with homes elsewhere: {misplaced}"


def test_engine_optim_checkpoint_and_inference_import_no_training_loop():
    """The any-model engine shares the LR schedules and optimizer math through optim/, never the
    GPT loop; checkpoints and inference sit below training and the engine."""
    rules = {"engine": ("megazero.training",), "optim": ("megazero.training", "megazero.engine"),
             "checkpoint": ("megazero.training", "megazero.engine", "megazero.inference"),
             "inference": ("megazero.training", "megazero.engine")}
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for pkg, forbidden in rules.items()
           for p in (ROOT / "megazero" / pkg).rglob("*.py") for mod, _, line in imports(p)
           if mod.startswith(forbidden)]
    assert not bad, "\n".join(bad)


def _import_graph() -> dict:
    """module -> the megazero modules it imports (module level and inside functions)."""
    mods, graph = _megazero_modules(), {}
    for m, path in mods.items():
        deps = set()
        for mod, name, _ in imports(path):
            target = f"{mod}.{name}" if f"{mod}.{name}" in mods else mod
            if target in mods and target != m:
                deps.add(target)
        graph[m] = deps
    return graph


def _cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_between_any_files():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]] and _cycles({"a": {"b"}, "b": set()}) == []


def _torch_file_calls(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("save", "load")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            yield node.lineno, f"torch.{node.func.attr}"


def test_every_checkpoint_file_is_written_and_read_under_checkpoint():
    home = ROOT / "megazero" / "checkpoint"
    bad = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in (ROOT / "megazero").rglob("*.py")
           if home not in p.parents for line, call in _torch_file_calls(p)]
    assert not bad, "torch.save/torch.load outside megazero/checkpoint/:\n" + "\n".join(bad)
