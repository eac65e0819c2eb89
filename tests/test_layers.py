"""The import structure of runner/ and plugins/: runner's folders are its layers (runner.LAYERS,
bottom to top), each importing only downwards; no loops; the pure modules (runner.PURE) never
import torch, Lightning, Hydra or plugins; one place makes plans.

Every import counts, also those inside functions (a lazy import still ties the modules), and so
does a module named in a string: a plan's component ("plugins.ddp:build_ddp") or a `_target_`
("runner.models.GPTDecoder") is imported where it is loaded, but the module that names it depends
on it all the same. The strategies and the config's contributors name their plugins that way:
saying what carries them out is their job (CONTRIBUTORS)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

import runner

PROJECT_ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "hydra", "omegaconf", "plugins")
# The layers whose modules contribute to the plan: they may name plugins/ components in strings.
CONTRIBUTORS = ("strategies", "config")
DOTTED_NAME = re.compile(r"^(?:runner|plugins)(?:\.\w+)+(?::\w+)?$")


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


def named_in_strings(name: str) -> Set[str]:
    """The project modules `name` names in string constants: a component's module ("x.y:attr"), or
    the longest module prefix of a dotted `_target_` ("x.y.Class")."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_NAME.match(node.value):
            parts = node.value.partition(":")[0].split(".")
            prefixes = [".".join(parts[:end]) for end in range(len(parts), 0, -1)]
            found.update(prefix for prefix in prefixes[:1 + (":" not in node.value)] if prefix in MODULES)
    return found - {name}


def top_name(name: str) -> str:
    """The layer entry of a module: `plugins`, or its name directly under runner/ (folder or module)."""
    parts = name.split(".")
    return "plugins" if parts[0] == "plugins" else (parts[1] if len(parts) > 1 else "")


def layer_of(name: str) -> int:
    if name == "runner":  # the package itself: LAYERS and its docstring, below everything
        return -1
    for index, layer in enumerate(runner.LAYERS):
        if top_name(name) in layer:
            return index
    raise AssertionError(f"{name}: {top_name(name)!r} is in no layer of runner.LAYERS (runner/__init__.py)")


def is_pure(name: str) -> bool:
    inner = name.split(".", 1)[1] if name.startswith("runner.") else ""
    return any(inner == pure or inner.startswith(pure + ".") for pure in runner.PURE)


def test_every_folder_of_runner_is_a_layer():
    """A new folder or module under runner/ must be placed in LAYERS; a layer names only what exists."""
    entries = {path.stem for path in (PROJECT_ROOT / "runner").iterdir()
               if path.suffix == ".py" and path.stem != "__init__" or (path / "__init__.py").is_file()}
    listed = {name for layer in runner.LAYERS for name in layer} - {"plugins"}
    assert entries == listed


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_the_layers(name):
    upward = sorted(other for other in project_imports(name) if layer_of(other) > layer_of(name))
    assert not upward, f"{name} (layer {layer_of(name)}) imports higher layers: {upward}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_named_in_strings_point_down_the_layers_too(name):
    contributes = top_name(name) in CONTRIBUTORS
    upward = sorted(other for other in named_in_strings(name) if layer_of(other) > layer_of(name)
                    and not (contributes and other.startswith("plugins.")))
    assert not upward, f"{name} (layer {layer_of(name)}) names higher layers in strings: {upward}"


def test_a_string_naming_a_higher_layer_is_caught():
    # The layer test's own check: config/checks.py named the rank's callbacks by string before
    # they moved up with the plan (runner/rank/callbacks.py, runner/command/planning.py).
    source = 'RUNNER = [Component("runner.rank.measure:RunMeter"), "runner.models.GPTDecoder", "plugins.ddp:build_ddp"]'
    named = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_NAME.match(node.value):
            named.add(node.value)
    assert named == {"runner.rank.measure:RunMeter", "runner.models.GPTDecoder", "plugins.ddp:build_ddp"}


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


@pytest.mark.parametrize("name", sorted(name for name in MODULES if is_pure(name)))
def test_the_pure_layer_imports_nothing_heavy(name):
    heavy = sorted(module for module in imports(name) if module.split(".")[0] in HEAVY)
    assert not heavy, f"{name} imports {heavy}"


def test_plugins_never_import_the_command_line():
    for name in MODULES:
        if name.startswith("plugins"):
            assert not {"runner.command.cli", "runner.command.launch", "runner.rank.train"} & imports(name), name


def test_one_place_makes_plans():
    callers = sorted(name for name, path in MODULES.items() if name != "runner.core.plan"
                     and any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                             == "make_plan" for node in ast.walk(ast.parse(path.read_text()))))
    assert callers == ["runner.command.planning"]
