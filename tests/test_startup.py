"""The command's fixed cost (issue 43, bench/startup.py): Python's garbage collector, which went over
the half a million objects torch and Lightning make some eight times before the first step and once
more at exit, is paused while a single run imports and checks, runs once before training, and
leaves what start-up made frozen, in the command, in the ranks it forks and in fresh ranks
(runner/core/collector.py).
Read from inside the run by tests/helpers/probe.py's Collector."""
from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest

from runner.command.cli import main
from runner.command.launch import FRESH_RANKS
from runner.core import collector

COLLECTOR = "+callbacks.collector._target_=tests.helpers.probe.Collector"


def collector_states(run: Path) -> dict:
    return {int(path.stem.removeprefix("collector.rank")): json.loads(path.read_text())
            for path in run.glob("collector.rank*.json")}


@pytest.mark.slow
def test_a_fresh_command_collects_once_before_its_first_step_and_trains_with_startup_frozen(lightfleet_fresh, tmp_path):
    done = lightfleet_fresh("experiment=quickstart", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                            "paths.output_dir=run", COLLECTOR)
    assert done.returncode == 0, done.stderr[-3000:]
    (state,) = collector_states(tmp_path / "run").values()
    # At most one, while Python and lightfleet's first modules load (before the command pauses
    # it); 7 to 8 without the pause.
    assert state["full_collections"] <= 1, state
    assert state["frozen"] > 100_000 and state["enabled"], state


@pytest.mark.slow
def test_forked_ranks_train_with_the_collector_on_and_the_commands_objects_frozen(lightfleet, tmp_path):
    done = lightfleet("trainer.devices=2", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run", COLLECTOR)
    assert done.returncode == 0, done.stderr[-3000:]
    states = collector_states(tmp_path / "run")
    assert sorted(states) == [0, 1]
    assert all(state["enabled"] and state["frozen"] > 100_000 for state in states.values()), states


@pytest.mark.slow
def test_fresh_ranks_import_with_the_collector_paused(lightfleet, tmp_path, monkeypatch):
    monkeypatch.setenv(FRESH_RANKS, "1")  # as where CUDA is: `python -m runner.train RUN_DIR`
    done = lightfleet("trainer.devices=2", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run", COLLECTOR)
    assert done.returncode == 0, done.stderr[-3000:]
    states = collector_states(tmp_path / "run")
    assert sorted(states) == [0, 1]
    assert all(state["full_collections"] <= 1 and state["frozen"] > 100_000 and state["enabled"]
               for state in states.values()), states


def test_a_refused_run_leaves_the_collector_as_it_found_it(capsys):
    assert gc.isenabled()
    with pytest.raises(SystemExit) as stop:
        main(["experiment=quickstart", "trainer.max_steps=-5"])
    assert stop.value.code == 2 and "trainer.max_steps" in capsys.readouterr().err
    assert gc.isenabled()


class Cycle:
    def __init__(self) -> None:
        self.itself = self


def unreachable_cycle() -> weakref.ref:
    return weakref.ref(Cycle())


def test_settle_collects_first_only_where_the_collector_was_on():
    try:
        with collector.paused():  # a single run: start-up's garbage is frozen, not collected
            paused = unreachable_cycle()
            collector.settle()
            assert gc.isenabled() and gc.get_freeze_count() > 0
        assert paused() is not None
        running = unreachable_cycle()  # a sweep's job: an earlier job's garbage is collected
        collector.settle()
        assert running() is None and paused() is not None
    finally:
        gc.unfreeze()
        gc.collect()
    assert paused() is None and gc.isenabled()
