"""One home per strategy: the registry, conf/strategy/, the table and docs/knobs.md agree, and a
strategy made of its own four files (config, strategy module, plugin, table row) is planned and
built without editing any other file. The plan's rules hold even where the table is wrong."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from runner import strategies
from runner.config.compat import load_table
from runner.core.paths import CONF_DIR
from tests.helpers.commands import PROJECT_ROOT


def test_registry_config_files_table_and_knob_reference_agree(spec_for):
    names = set(strategies.names())
    assert names == {path.stem for path in (CONF_DIR / "strategy").glob("*.yaml")}
    assert names == set(strategies.schemas())
    table = load_table()
    assert set(table.known) == names
    assert set().union(*table.allowed) <= names  # every row names strategies that exist
    knobs = (PROJECT_ROOT / "docs" / "knobs.md").read_text()
    assert {line.split("`")[1].removeprefix("strategy.") for line in knobs.splitlines()
            if line.startswith("## `strategy.")} == names
    for name, schema in strategies.schemas().items():  # each config file selects its schema and gets its defaults
        assert set(yaml.safe_load((CONF_DIR / "strategy" / f"{name}.yaml").read_text())) == {name}
        assert spec_for(f"strategy=[{name}]").strategies[name] == schema(), name


def test_a_table_naming_no_strategy_is_an_error(tmp_path):
    from runner.core.errors import ConfigError

    (tmp_path / "compat.yaml").write_text("allowed:\n  - [amp, recompte]\n")
    with pytest.raises(ConfigError, match=r"^conf/compat.yaml='recompte': names no strategy.*did you mean recompute"):
        load_table(tmp_path)


@pytest.fixture
def project_copy(tmp_path: Path):
    """A copy of the project's code and configs; `run(*args)` runs its lightfleet command there."""
    root = tmp_path / "project"
    for part in ("runner", "plugins", "conf", "experiments"):
        shutil.copytree(PROJECT_ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))

    def run(*args: str) -> subprocess.CompletedProcess:
        # `python -m runner` from the copy's root imports the copy, not the installed project.
        return subprocess.run([sys.executable, "-m", "runner", *args], cwd=root, capture_output=True, text=True,
                              timeout=300)

    run.root = root
    return run


THROWAWAY = {
    "conf/strategy/throwaway.yaml": """
        # A strategy defined by a test: counts optimizer steps into a file.
        throwaway: {}
        """,
    "runner/strategies/throwaway.py": '''
        """throwaway: a strategy written by a test; carried out by plugins/throwaway.py."""
        from dataclasses import dataclass
        from typing import ClassVar

        from runner.core.contribution import Component, Contribution, RunShape, Strategy


        @dataclass
        class ThrowawayConfig(Strategy):
            """Counts optimizer steps."""

            name: ClassVar[str] = "throwaway"

            label: str = "default"
            """Written beside the count."""

            def contribute(self, run: RunShape) -> Contribution:
                return Contribution(callbacks=[Component("plugins.throwaway:StepCounter", {"label": self.label})])
        ''',
    "plugins/throwaway.py": '''
        """throwaway: a callback that writes the label and the optimizer steps it saw."""
        from pathlib import Path

        import pytorch_lightning as pl


        class StepCounter(pl.Callback):
            def __init__(self, label):
                self.label, self.steps = label, 0

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                self.steps += 1

            def on_fit_end(self, trainer, pl_module):
                Path(trainer.default_root_dir, "throwaway.txt").write_text(f"{self.label} {self.steps}")
        ''',
}


@pytest.mark.slow
def test_a_new_strategy_is_four_new_files_and_nothing_else(project_copy):
    for path, text in THROWAWAY.items():
        (project_copy.root / path).write_text(textwrap.dedent(text).lstrip())
    assert "\nstrategy: " in (help := project_copy("--help")).stdout and "throwaway" in help.stdout
    planned = project_copy("dry_run=true", "strategy=[throwaway]", "strategy.throwaway.label=mine")
    assert planned.returncode == 0, planned.stderr
    assert "plugins.throwaway:StepCounter(label='mine')  <- throwaway" in planned.stdout
    done = project_copy("strategy=[throwaway]", "strategy.throwaway.label=mine", "paths.output_dir=run",
                        "trainer.max_steps=3", "trainer.enable_progress_bar=false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (project_copy.root / "run" / "throwaway.txt").read_text() == "mine 3"
    # With others only once a table row allows it.
    refused = project_copy("strategy=[amp,throwaway]")
    assert refused.returncode == 2 and "amp+throwaway is not an allowed combination" in refused.stderr


def test_a_table_allowing_sharding_with_a_communication_hook_is_overruled_by_the_plan(project_copy):
    table = project_copy.root / "conf" / "compat.yaml"
    table.write_text(table.read_text().replace("allowed:\n", "allowed:\n  - [sharding, fp16_allreduce]\n", 1))
    done = project_copy("strategy=[sharding,fp16_allreduce]", "trainer.devices=2", "paths.output_dir=run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "lightfleet: refused: sharding and fp16_allreduce both own the gradient communication hook: sharding's "
        "Lightning strategy (plugins.sharding:build_zero_stage1) communicates gradients itself and takes no hook; "
        "choose one of them"]
    assert not (project_copy.root / "run").exists()
