"""How many tests each of some pytest selections selects (tests/test_suite_shape.py asks it of the
mutants' selections in tests/mutations.py: one that selects nothing catches no mutant).

A selection is the arguments of one pytest run: a test file, alone or with `-k EXPRESSION`.
`selected_counts` collects every file the selections name in one pytest process, with this module
as a plugin: there, each selection's expression is matched against the collected tests of its
file by pytest's own `-k` parser and keyword matcher (a test's name with its parametrize id, its
parents' names, its markers), as the selection's own run would match it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from tests.helpers.commands import PROJECT_ROOT, command_env

Selection = Tuple[str, ...]  # (path,) or (path, "-k", expression)
REQUEST = "LIGHTFLEET_SELECTIONS"  # the JSON file: {"selections": [...]} in, {"counts": [...]} back


def selected_counts(selections: Sequence[Selection], timeout: float = 300) -> Dict[Selection, int]:
    """Each selection's number of selected tests, collected from the project's root."""
    files = sorted({selection[0] for selection in selections})
    with tempfile.TemporaryDirectory() as scratch:
        request = Path(scratch) / "selections.json"
        request.write_text(json.dumps({"selections": [list(selection) for selection in selections]}))
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-p", __name__, *files], cwd=PROJECT_ROOT, env=command_env(**{REQUEST: str(request)}),
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        counts = json.loads(request.read_text())["counts"]
    return dict(zip(map(tuple, selections), counts))


def pytest_collection_finish(session) -> None:
    """In the collecting process: count each requested selection's tests among those collected."""
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    request = Path(os.environ[REQUEST])
    counts: List[int] = []
    for path, *rest in json.loads(request.read_text())["selections"]:
        items = [item for item in session.items if item.nodeid.split("::")[0] == path]
        if rest:
            assert rest[0] == "-k" and len(rest) == 2, f"{path} {rest}: only -k EXPRESSION is understood"
            expression = Expression.compile(rest[1])
            items = [item for item in items if expression.evaluate(KeywordMatcher.from_item(item))]
        counts.append(len(items))
    request.write_text(json.dumps({"counts": counts}))
