"""The preflight (runner/command/preflight.py): one ordered list of every check the command makes,
run once per job, its result taken by the job; ranks check nothing again."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.command import cli, preflight
from runner.config.compose import CONFIG_NAME
from runner.core.errors import ConfigError
from tests.helpers.data_files import token_file

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
        "table, from the command line", "compose", "strategy list, from the command line", "schema and ranges",
        "cross-field rules", "the rehearsed device", "table", "checkpoint", "plan",
        "world and devices", "targets and the model on the meta device", "the model on one batch",
        "the plan on the model", "the checkpoint on the model",
        "directories"]
    assert [stage.name for stage in preflight.JOB_STAGES] == preflight.stage_names()[2:-1]
    # A run skips the rehearsal's own stage; a rehearsal (lightfleet rehearse) the cluster's devices.
    job = preflight.stage_names()[2:-1]
    assert [stage.name for stage in preflight.JOB_STAGES if stage.runs_in(rehearsal=False)] == [
        name for name in job if name != "the rehearsed device"]
    assert [stage.name for stage in preflight.JOB_STAGES if stage.runs_in(rehearsal=True)] == [
        name for name in job if name != "world and devices"]


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


def checked(*overrides: str) -> preflight.Flight:
    """The command's job stages on these overrides, in this process, as for a single run."""
    return preflight.check_job(preflight.compose(list(overrides), None, CONFIG_NAME))


def typed_list_note(typed: str, dropped: str, why: str) -> str:
    return f"strategy=[{typed}] on the command line is the whole selection: the config files' settings for " \
           f"{dropped} are dropped ({why})"


def test_a_typed_strategy_list_drops_the_experiments_knobs_of_the_strategies_left_out():
    # resnet_amp_recompute selects amp and recompute and sets amp's dtype: the user's list is the whole selection.
    nothing = checked("experiment=resnet_amp_recompute", "strategy=[]")
    assert nothing.plan.strategies == [] and nothing.spec.cfg.strategy.amp is None
    assert nothing.plan.notes == [typed_list_note("", "amp", "add amp to the list to keep them")]
    recompute = checked("experiment=resnet_amp_recompute", "strategy=[recompute]")
    assert recompute.plan.strategies == ["recompute"]
    assert recompute.plan.notes[0] == typed_list_note("recompute", "amp", "add amp to the list to keep them")
    # The experiment's knobs of a strategy in the list are kept (lars's exclusions; Fleet's default excludes none).
    lars = checked("experiment=resnet_amp_recompute_lars", "strategy=[recompute,lars]")
    assert sorted(lars.plan.strategies) == ["lars", "recompute"]
    assert lars.spec.strategies["lars"].exclude_from_weight_decay == ["bn", "bias"]
    assert lars.plan.notes[0] == typed_list_note("recompute,lars", "amp", "add amp to the list to keep them")


def test_without_a_typed_list_the_experiment_selects_as_it_says():
    flight = checked("experiment=resnet_amp_recompute")
    assert flight.plan.strategies == ["amp", "recompute"] and flight.spec.strategies["amp"].dtype == "bfloat16"
    assert not any("whole selection" in note for note in flight.plan.notes)


def test_a_typed_auto_over_an_experiment_is_auto_alone(tmp_path):
    files = [f"data.{split}_bin={token_file(tmp_path / f'{split}.bin', 4_000)}" for split in ("train", "val")]
    flight = checked("experiment=gpt2_124m", "strategy=[auto]", *files, "model.d_model=64", "model.n_layers=2",
                     "model.n_heads=4", "data.seq_len=64", "fast_path.compile=false")
    assert flight.plan.strategies == ["auto"]
    assert flight.plan.notes[0] == typed_list_note("auto", "amp, gradient_merge", "auto is used alone")


@pytest.mark.parametrize("experiment", [(), ("experiment=resnet_amp_recompute",)], ids=["alone", "experiment"])
def test_a_knob_typed_for_a_strategy_left_out_of_the_typed_list_is_refused(experiment):
    with pytest.raises(ConfigError, match=r"^strategy.amp.dtype: strategy amp is not selected; add it to "
                                          r"strategy=\[...\] to set its knobs$"):
        checked(*experiment, "strategy=[recompute]", "strategy.amp.dtype=float16")


def test_each_sweep_job_is_its_own_typed_list(capsys):
    assert cli.check_sweep(["experiment=resnet_amp_recompute", "strategy=[],[recompute]", "dry_run=true"], None,
                           CONFIG_NAME) is None  # a dry run: each job's plan printed
    jobs = capsys.readouterr().out.split("--- job ")[1:]
    assert [job.splitlines()[:2] for job in jobs] == [
        ["0: experiment=resnet_amp_recompute strategy=[] dry_run=True", "strategies: (none)"],
        ["1: experiment=resnet_amp_recompute strategy=[recompute] dry_run=True", "strategies: recompute"]]
    assert f"note: {typed_list_note('', 'amp', 'add amp to the list to keep them')}" in jobs[0]
    assert f"note: {typed_list_note('recompute', 'amp', 'add amp to the list to keep them')}" in jobs[1]


# Every form an override takes (Hydra's set, add, add-or-set and delete) for a knob of a strategy the
# selection leaves out: the default empty selection, a typed list, and a typed list over an
# experiment that selects the strategy and sets the knob.
KNOB_FORMS = ["strategy.amp.dtype=float16", "+strategy.amp.dtype=float16", "++strategy.amp.dtype=float16",
              "~strategy.amp.dtype", "+strategy.amp.x=1", "++strategy.amp.x=1"]


@pytest.mark.parametrize("form", KNOB_FORMS)
@pytest.mark.parametrize("selection", [(), ("strategy=[recompute]",),
                                       ("experiment=resnet_amp_recompute", "strategy=[recompute]")],
                         ids=["default", "typed", "typed_over_experiment"])
def test_every_override_form_of_a_knob_of_a_strategy_left_out_is_refused(selection, form):
    knob = form.lstrip("+~").partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(knob)}: strategy amp is not selected; add it to "
                                          r"strategy=\[...\] to set its knobs$"):
        checked(*selection, form)
