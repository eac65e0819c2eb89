"""The import structure of runner/ and plugins/: layers that import only downwards, no loops, a
pure layer that never imports torch, Lightning or plugins, and one place that makes plans.

Every import counts, also those inside functions (a lazy import still ties the modules)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Bottom to top; a module may import modules of its own layer or of layers below it.
LAYERS = [
    ["runner", "plugins", "runner.errors", "runner.clock"],
    ["runner.world"],
    ["runner.contribution"],
    ["runner.strategies", "runner.strategies.*"],
    ["runner.schema"],
    ["runner.compat", "runner.plan", "runner.knobs"],
    ["runner.config"],
    ["runner.records"],
    ["runner.report", "runner.fleet"],
    ["plugins.*", "runner.models", "runner.data", "runner.measure", "runner.arguments",
     "runner.preemption"],
    ["runner.build"],
    ["runner.train"],
    ["runner.launch"],
    ["runner.autotune"],
    ["runner.job"],
    ["runner.cli", "runner.__main__"],
]
PURE_LAYERS = 6  # the layers up to the plan: no torch, Lightning, Hydra or plugins
HEAVY = ("torch", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "hydra", "omegaconf", "plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {module_name(path): path for package in ("runner", "plugins")
                            for path in sorted((PROJECT_ROOT / package).rglob("*.py"))}


def imports(name: str) -> Set[str]:
    """Every module `name` imports, anywhere in its source, absolute names."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{name}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from package import module`
    return found


def project_imports(name: str) -> Set[str]:
    return {other for other in imports(name) if other in MODULES and other != name}


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])) for pattern in layer):
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_layers.py")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_the_layers(name):
    upward = sorted(other for other in project_imports(name) if layer_of(other) > layer_of(name))
    assert not upward, f"{name} (layer {layer_of(name)}) imports higher layers: {upward}"


def test_no_import_loops():
    graph = {name: project_imports(name) for name in MODULES}
    loops: List[List[str]] = []
    state: Dict[str, str] = {}  # name -> "open" while on the DFS path, "done" after

    def visit(name: str, path: List[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                loops.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not loops, f"import loops: {[' -> '.join(loop) for loop in loops]}"


@pytest.mark.parametrize("name", sorted(name for name in MODULES if layer_of(name) < PURE_LAYERS))
def test_the_pure_layer_imports_nothing_heavy(name):
    heavy = sorted(module for module in imports(name) if module.split(".")[0] in HEAVY)
    assert not heavy, f"{name} imports {heavy}"


def test_plugins_never_import_the_command_line():
    for name in MODULES:
        if name.startswith("plugins"):
            assert not {"runner.cli", "runner.launch", "runner.train"} & imports(name), name


def test_one_place_makes_plans():
    callers = sorted(name for name, path in MODULES.items() if name != "runner.plan"
                     and any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                             == "make_plan" for node in ast.walk(ast.parse(path.read_text()))))
    assert callers == ["runner.config"]
