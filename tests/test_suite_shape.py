"""The suite's own shape: test modules are imported by pytest alone (what they share lives in
tests/helpers/, tests.helpers.*); every strategy's declared test data (tests/helpers/strategies.py)
is there for the strategies that exist; and every mutant of tests/mutations.py can be planted in
today's code and runs tests that exist.

A module is loaded by name in three ways, each read from the source: an import (also inside a
function), a call of importlib's import_module (or __import__, runpy, a spec from a file), and a
run's `_target_` override ("+callbacks.x._target_=tests.helpers.probe.Effects"), which the run
imports in its own processes."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List

from runner import strategies
from runner.config.compat import load_table
from tests.helpers.commands import PROJECT_ROOT
from tests.helpers.selections import selected_counts
from tests.helpers.strategies import STRATEGIES
from tests.mutations import MUTANTS, find_mutant_errors

TESTS = PROJECT_ROOT / "tests"
LOADERS = ("import_module", "__import__", "run_module", "run_path", "spec_from_file_location", "find_spec")
TARGET = re.compile(r"_target_\s*[=:]\s*['\"]?([\w.]+)")


def is_test_module(dotted: str) -> bool:
    """Whether a dotted module name (or a `_target_`'s module.attribute) names a test module."""
    return any(part.startswith("test_") for part in dotted.split("."))


def loaded_test_modules(source: str) -> List[str]:
    """What `source` loads that is a test module, by import, by importlib and the like, or as a `_target_`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(f"{node.module or ''}.{alias.name}" for alias in node.names)]
            found += [name.lstrip(".") for name in names if is_test_module(name)][:1]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in LOADERS:
            text = ast.unparse(node)
            found += [text] if "test_" in text else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [target for target in TARGET.findall(node.value) if is_test_module(target)]
    return found


def python_files() -> List[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def test_no_module_of_the_tests_loads_a_test_module():
    loading = {str(path.relative_to(PROJECT_ROOT)): loaded_test_modules(path.read_text()) for path in python_files()}
    assert {path: loaded for path, loaded in loading.items() if loaded} == {}, (
        "a test module is for pytest to import: move what others need into tests/helpers/")


def test_each_way_of_loading_a_test_module_is_caught():
    # The check's own check: what the suite did before tests/helpers/ (test_combinations imported
    # test_resume, probe imported each strategy's test module, a run loaded a callback from one).
    # TARGET stands for `_target_` and TEST_ for `test_`, so that this module's own text names and
    # imports no test module, not even in a string.
    source = '''
from TEST_resume import resumes_exactly
from tests.plugins.TEST_amp import WIRING
from tests.plugins import TEST_lars
import tests.TEST_hydra_app as app

def strategy_tests(name):
    return importlib.import_module(f"TEST_{name}")

PROBE = "+callbacks.probe.TARGET=TEST_collective.CollectiveProbe"
FINE = ("+callbacks.final.TARGET=tests.helpers.probe.FinalState", "tests/TEST_resume.py", "TEST_x.py")
'''.replace("TARGET", "_target_").replace("TEST_", "test_")
    assert sorted(loaded_test_modules(source)) == sorted([
        "test_resume", "tests.plugins.test_amp", "tests.plugins.test_lars", "tests.test_hydra_app",
        "importlib.import_module(f'test_{name}')", "test_collective.CollectiveProbe"])


def test_the_strategies_declared_test_data_are_those_of_the_registry():
    assert sorted(STRATEGIES) == sorted(strategies.names())
    in_rows = {name for row in load_table().allowed for name in row}
    assert sorted(name for name in in_rows if STRATEGIES[name].row_effect is None) == []


def test_every_mutant_can_be_planted_in_todays_code():
    assert find_mutant_errors(PROJECT_ROOT, MUTANTS) == {}


def test_every_mutants_selection_selects_tests():
    selections = sorted({selection for mutant in MUTANTS for selection in mutant.selection})
    assert all(len(selection) == 1 or (len(selection) == 3 and selection[1] == "-k") for selection in selections)
    counts = selected_counts(selections)
    assert {" ".join(selection): count for selection, count in counts.items() if not count} == {}
