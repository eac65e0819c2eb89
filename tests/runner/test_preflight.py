"""The preflight (runner/command/preflight.py): one ordered list of every check the command makes,
run once per job, its result taken by the job; ranks check nothing again."""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.command import preflight

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# A user's model that notes every construction and the device its parameters are on.
COUNTED_MODEL = '''
from runner.models import MLPClassifier


class CountedMLP(MLPClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with open({log!r}, "a") as log:
            log.write(next(self.parameters()).device.type + "\\n")
'''
QUICK = ("trainer.max_steps=2", "trainer.limit_val_batches=0", "logger=none", "callbacks=none")


def test_docs_list_the_stages_in_order():
    assert (PROJECT_ROOT / "docs" / "preflight.md").read_text() == preflight.document()


def test_the_stages_run_in_the_order_the_design_names():
    assert preflight.stage_names() == [
        "table, from the command line", "compose", "schema and ranges", "cross-field rules", "table", "plan",
        "world and devices", "targets and the model on the meta device", "the model on one batch",
        "the plan on the model", "checkpoint",
        "directories"]
    assert [stage.name for stage in preflight.JOB_STAGES] == preflight.stage_names()[2:-1]


@pytest.mark.parametrize("overrides, refusal", [
    # a bad knob and a forbidden pair: the schema comes before the table
    (("strategy.lamb.lamb_weight_decay=-1",), "strategy.lamb.lamb_weight_decay=-1.0: must be >= 0"),
    # a forbidden pair and a bad model argument: the table comes before the targets
    (("model.num_blocks=abc",), "refused: lamb+lars"),
])
def test_an_earlier_stage_refuses_first(lightfleet, tmp_path, overrides, refusal):
    # The pair comes from an experiment, so that the command line's fast table check does not decide it.
    experiment = tmp_path / "mine" / "experiment" / "both.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text("# @package _global_\ndefaults:\n  - override /strategy: [lars, lamb]\n")
    done = lightfleet("-cd", "mine", "experiment=both", *overrides)
    assert done.returncode == 2, done.stderr
    assert refusal in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "outputs").exists()


def count_builds(log: Path) -> dict:
    lines = log.read_text().split() if log.exists() else []
    return {device: lines.count(device) for device in sorted(set(lines))}


@pytest.fixture
def counted_model(tmp_path: Path) -> Path:
    log = tmp_path / "builds.txt"
    (tmp_path / "counted.py").write_text(COUNTED_MODEL.format(log=str(log)))
    return log


@pytest.mark.slow
def test_the_model_is_built_on_the_meta_device_once_per_command(lightfleet, counted_model):
    done = lightfleet("model._target_=counted.CountedMLP", "dry_run=true")
    assert done.returncode == 0, done.stderr
    assert count_builds(counted_model) == {"meta": 1}
    counted_model.unlink()

    done = lightfleet("model._target_=counted.CountedMLP", "trainer.devices=2", *QUICK, timeout=600)
    assert done.returncode == 0, done.stderr
    assert count_builds(counted_model) == {"cpu": 2, "meta": 1}  # the ranks build it for real, and check nothing
    counted_model.unlink()

    done = lightfleet("-m", "model._target_=counted.CountedMLP", "seed=0,1", *QUICK, timeout=600)
    assert done.returncode == 0, done.stderr
    assert count_builds(counted_model) == {"cpu": 2, "meta": 2}  # once per job
