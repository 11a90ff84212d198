"""The package's layers (docs/INTERNALS.md, shared DESIGN): calls only go down, and no circles.

Every module's imports are read with `ast` (also those under TYPE_CHECKING and inside
functions), so a shortcut anywhere in the code fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "astream"

# Top to bottom. A module may import its own layer or any layer below it.
LAYERS = [
    ("face", ["astream.face", "astream.server", "astream.eval"]),
    ("engine", ["astream.engine", "astream.stages"]),
    ("core", ["astream.core", "astream.executor", "astream.parallel"]),
    ("parts", ["astream.kvcache", "astream.policies", "astream.models"]),
    ("kernels", ["astream.ops", "astream.runtime"]),
    ("base", ["astream.base", "astream.text"]),
]

# Rules finer than the layers (DESIGN.md: "Stages speak to EngineCore only", "kvcache/ takes
# plain numbers and small protocols", "The scheduler imports no torch").
FORBIDDEN = [
    ("astream.stages", "astream.executor"), ("astream.stages", "astream.core.scheduler"),
    ("astream.stages", "astream.core.sequence"), ("astream.stages", "astream.kvcache"),
    ("astream.stages", "astream.models"), ("astream.stages", "astream.policies"),
    ("astream.stages", "astream.parallel"),
    ("astream.kvcache", "astream.core.sequence"), ("astream.kvcache", "astream.base.config"),
    ("astream.core.scheduler", "torch"), ("astream.core.wait_queue", "torch"), ("astream.core.sequence", "torch"),
    ("astream.kvcache.block_manager", "torch"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path) if path.name == "__init__.py" else \
                    module_name(path).rsplit(".", 1)[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import x` imports module pkg.x when there is one, else pkg itself:
            # real_module() resolves each name to the longest prefix that is a module.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def all_modules() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def real_module(name: str, modules: dict) -> str | None:
    """`astream.a.b.Name` -> the longest prefix that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_layer():
    unplaced = [m for m in all_modules() if m != "astream" and layer_of(m) is None]
    assert not unplaced, f"modules with no layer: {unplaced}"


def test_every_module_lives_in_a_layer_folder():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at the top of astream/, outside every layer's folder: {loose}"


def test_imports_only_go_down():
    upward = upward_imports(all_modules())
    assert not upward, "upward imports:\n" + "\n".join(upward)


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, imported in modules.items():
        own = layer_of(module)
        for name in imported:
            target = real_module(name, modules) if name.startswith("astream") else None
            if target is None or target == "astream" or own is None:
                continue
            if layer_of(target) < own:
                upward.append(f"{module} -> {target} ({LAYERS[own][0]} -> {LAYERS[layer_of(target)][0]})")
    return sorted(set(upward))


@pytest.mark.parametrize("source, target", FORBIDDEN)
def test_forbidden_edges(source, target):
    modules = all_modules()
    offenders = [m for m, imported in modules.items()
                 if (m == source or m.startswith(source + "."))
                 and any(i == target or i.startswith(target + ".") for i in imported)]
    assert not offenders, f"{offenders} import {target}"


def test_no_import_circles():
    modules = all_modules()
    graph = {m: {t for i in imported if i.startswith("astream")
                 if (t := real_module(i, modules)) not in (None, m, "astream")}
             for m, imported in modules.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}                 # 1: on the current path, 2: done
    for root in graph:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("from astream.engine.engine import Engine\nif False:\n    import astream.core.engine_core\n")
    assert {"astream.engine.engine.Engine", "astream.core.engine_core"} <= imports_of(planted)
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    planted_map = {"astream.core.engine_core": {"astream.engine.engine.Engine", "astream.base.sampling.SamplingParams"},
                   "astream.engine.engine": set(), "astream.base.sampling": set()}
    assert upward_imports(planted_map) == ["astream.core.engine_core -> astream.engine.engine (core -> engine)"]
