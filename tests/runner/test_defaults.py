"""A strategy knob's default and allowed range are written once: in its dataclass
(runner/strategies/<name>.py), which docs/knobs.md is generated from. conf/ selects the schema
and restates no default; the plugins' entry points (the Component targets a strategy names) and
the classes and functions they call take the values the plan gives them; no plugin checks a
knob's range again. Each test below fails on a second copy."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set

import pytest
import yaml

from runner import strategies
from runner.config import schema
from runner.core.paths import CONF_DIR
from tests.helpers.commands import PROJECT_ROOT
from runner.core.contribution import Component, Contribution, RunShape
from runner.core.world import World

KNOBS: Dict[str, Set[str]] = {name: {field.name for field in dataclasses.fields(knobs)}
                              for name, knobs in strategies.schemas().items()}
PLUGIN_FILES = sorted((PROJECT_ROOT / "plugins").glob("*.py"))


# --------------------------------------------------------------------------- conf/ restates no default


@pytest.mark.parametrize("name", strategies.names())
def test_a_strategy_config_file_selects_its_schema_and_sets_no_knob(name):
    path = CONF_DIR / "strategy" / f"{name}.yaml"
    assert yaml.safe_load(path.read_text()) == {name: {}}, (
        f"{path.relative_to(PROJECT_ROOT)} sets knobs: their defaults live in "
        f"{strategies.schemas()[name].__name__} (runner/strategies/{name}.py) only; write `{name}: {{}}`")


@pytest.mark.parametrize("group, knobs", [("collective", schema.CollectiveConfig), ("fast_path", schema.FastPathConfig),
                                          ("rehearse", schema.RehearseConfig)])
def test_the_collective_and_fast_path_config_files_set_no_knob(group, knobs):
    path = CONF_DIR / group / "default.yaml"
    home = Path(inspect.getsourcefile(knobs)).relative_to(PROJECT_ROOT)
    assert yaml.safe_load(path.read_text()) == {}, (
        f"{path.relative_to(PROJECT_ROOT)} sets knobs: their defaults live in {knobs.__name__} ({home}) only; "
        f"write `{{}}`")


# --------------------------------------------------------------------------- plugins take the values they are given


def strategy_source(name: str) -> ast.AST:
    """The strategy's module, with those of the strategy bases it derives from (localsgd's family)."""
    modules = {klass.__module__ for klass in strategies.schemas()[name].__mro__ if klass.__module__.startswith("runner.strategies.")}
    return ast.Module(body=[node for module in sorted(modules)
                            for node in ast.parse(inspect.getsource(importlib.import_module(module))).body], type_ignores=[])


def named_components(name: str) -> Set[str]:
    """The targets of every `Component("module:attr", ...)` written in the strategy's module, in
    all its branches (read from the source, so that no run shape is needed to reach them)."""
    return {node.args[0].value for node in ast.walk(strategy_source(name))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Component"
            and node.args and isinstance(node.args[0], ast.Constant)}


def plan_supplied(name: str) -> Set[str]:
    """What the strategy's plan entries may hand a plugin: its knobs, and every key of a dict
    written in its module (the Component arguments it derives, such as shard_optimizer_states)."""
    keys = {key.value for node in ast.walk(strategy_source(name)) if isinstance(node, ast.Dict)
            for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    return KNOBS[name] | keys


def contributed(contribution: Contribution) -> List[Component]:
    slots = [contribution.precision, contribution.lightning_strategy, contribution.optimizer, contribution.comm_hook]
    return [*filter(None, slots), *(component for _, component in contribution.model_transforms),
            *contribution.callbacks]


def representative_contribution(name: str) -> Contribution:
    """What the strategy at its defaults adds to a 4-process run with batches of 16."""
    knobs = strategies.schemas()[name]()
    return knobs.contribute(RunShape(World(4, 1, 4), batch_size=16, selected={name: knobs}))


def plugin_callables(target: Any) -> Iterator[Any]:
    """The classes and functions of plugins/ that `target`'s source names (`f`, `module.f`), and
    the plugins/ classes a class derives from: what builds the objects carrying out its knobs."""
    module = sys.modules[target.__module__]
    for node in ast.walk(ast.parse(inspect.cleandoc("\n" + inspect.getsource(target)))):
        if isinstance(node, ast.Name):
            found = getattr(module, node.id, None)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found = getattr(getattr(module, node.value.id, None), node.attr, None)
        else:
            continue
        if (inspect.isclass(found) or inspect.isfunction(found)) and found.__module__.startswith("plugins.") \
                and found is not target:
            yield found
    if inspect.isclass(target):
        yield from (base for base in target.__mro__[1:] if base.__module__.startswith("plugins."))


def defaulted(function: Any) -> Set[str]:
    """Names of `function`'s (a class: its __init__'s) parameters that have a default."""
    return {parameter.name for parameter in inspect.signature(function).parameters.values()
            if parameter.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", strategies.names())
def test_plugin_entry_points_and_what_they_call_default_nothing_the_plan_supplies(name):
    targets, supplied = named_components(name), plan_supplied(name)
    assert {c.target for c in contributed(representative_contribution(name))} <= targets, \
        "a Component target is built at run time: name it as a string literal in the strategy's module"
    for target in sorted(targets):
        entry_point = Component(target).load()
        for function in (entry_point, *plugin_callables(entry_point)):
            copies = defaulted(function) & supplied
            assert not copies, f"{function.__module__}.{function.__qualname__} (for {target}) gives {sorted(copies)} " \
                               f"defaults: the plan always supplies them, from runner/strategies/{name}.py"


# --------------------------------------------------------------------------- no plugin checks a knob's range


def names_a_knob(node: ast.AST, knobs: Set[str]) -> bool:
    """`knob`, `x.knob` or `x["knob"]`."""
    if isinstance(node, ast.Name):
        return node.id in knobs
    if isinstance(node, ast.Attribute):
        return node.attr in knobs
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in knobs


def is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def range_checks(source: str, knobs: Set[str]) -> List[str]:
    """Comparisons of a knob with a number literal (`k_steps < 1`, `0 < self.decr_ratio < 1`,
    `require(group["epsilon"] >= 0, ...)`), as source lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names_a_knob(o, knobs) for o in operands) and any(is_number(o) for o in operands):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=[path.name for path in PLUGIN_FILES])
def test_no_plugin_checks_a_knob_range(path: Path):
    found = range_checks(path.read_text(), set().union(*KNOBS.values()))
    assert not found, f"plugins/{path.name} compares knobs with numbers ({'; '.join(found)}): a knob's range " \
                      f"is checked in its dataclass's __post_init__ (runner/strategies/) only"


def test_the_range_scan_sees_the_forms_a_check_takes():
    knobs = {"k_steps", "decr_ratio", "epsilon"}
    for check in ("if k_steps < 1:\n    raise ValueError()", "require(0 < self.decr_ratio < 1, 'k', 1, 'm')",
                  "assert group['epsilon'] >= -0.0"):
        assert range_checks(check, knobs), check
    assert not range_checks("if step >= self.k_steps or k_steps == other:\n    pass", knobs)
