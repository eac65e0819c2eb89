"""Every knob of every strategy reaches what carries it out: set to a non-default value on the
command line, it is seen with that value by the optimizer, hook state, callback, precision
plugin, Lightning strategy or model transform of a real run (read by tests/helpers/probe.py:Wiring).

Generated from the registry: each strategy's `wiring` in tests/helpers/strategies.py lists its
knobs' cases, and a knob without one fails here."""
from __future__ import annotations

import dataclasses
import json

import pytest

from runner import strategies
from tests.helpers.strategies import STRATEGIES

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

def wiring(name: str) -> list:
    """The strategy's wiring cases; none where tests/helpers/strategies.py declares no section for it."""
    return STRATEGIES[name].wiring if name in STRATEGIES else []


CASES = [(name, index) for name in strategies.names() for index in range(len(wiring(name)))]
FAST = ["trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false"]


@pytest.mark.parametrize("name", strategies.names())
def test_every_knob_has_a_wiring_case(name):
    knobs = {field.name for field in dataclasses.fields(strategies.schemas()[name])}
    covered = {knob for case in wiring(name) for knob in case.knobs}
    assert covered == knobs, f"tests/helpers/strategies.py: {name}'s wiring misses {sorted(knobs - covered)}"


@pytest.mark.parametrize("name, index", CASES, ids=[f"{name}-{index}" for name, index in CASES])
def test_knobs_set_on_the_command_line_reach_the_plugins(name, index, lightfleet, tmp_path):
    case = wiring(name)[index]
    defaults = strategies.schemas()[name]()
    for knob_name, knob in case.knobs.items():
        assert knob.value != getattr(defaults, knob_name), f"{name}.{knob_name}: set a non-default value"
    selection = next((o for o in case.overrides if o.startswith("strategy=")), f"strategy=[{name}]")
    probe = [] if case.from_run_dir else ["+callbacks.probe._target_=tests.helpers.probe.Wiring",
                                          f"+callbacks.probe.strategy={name}", f"+callbacks.probe.case={index}"]
    done = lightfleet(selection, *[o for o in case.overrides if o != selection],
                      *[knob.override(name, knob_name) for knob_name, knob in case.knobs.items()],
                      "paths.output_dir=run", *probe, *FAST)
    assert done.returncode == 0, done.stderr[-3000:]
    if case.from_run_dir:
        seen = {knob_name: knob.read(tmp_path / "run") for knob_name, knob in case.knobs.items()}
    else:
        seen = json.loads((tmp_path / "run" / "wiring.json").read_text())
    for knob_name, knob in case.knobs.items():
        expected = knob.value if knob.expected is None else knob.expected
        assert seen[knob_name] == expected, f"strategy.{name}.{knob_name}: set {knob.value!r}, the plugin has " \
                                            f"{seen[knob_name]!r}"
