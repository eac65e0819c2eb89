"""Bad command lines, generated from the schema: every knob with a wrong type, a non-finite number
and a typo in its name; every config group with an unknown option; malformed syntax; and the
bad inputs a new user tries (issue: reliability). Each must end in exit status 2 with one line
on stderr, no traceback, and nothing created. They run in this process through the command's
own entry point (`runner.command.cli.main`): the refusal path, a few milliseconds each. `dry_run=true`
rides along, so a line wrongly accepted prints a plan instead of training; bad run directories,
which only a real run checks, are refused before anything starts."""
from __future__ import annotations

import os
import re
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from runner import strategies
from runner.config import collective, schema
from runner.command.cli import main
from runner.core.paths import USER_DIR

GROUPS = {"model": "mlp", "model/optimizer": "adamw", "data": "classification", "trainer": "cpu", "logger": "csv",
          "callbacks": "default", "collective": "default", "debug": "fdr", "experiment": "quickstart"}
# What a new user tries: values of the wrong kind, out of Lightning's ranges, devices this
# machine lacks, paths that cannot be run directories, and syntax Hydra cannot read.
BY_HAND = [
    ["model.hidden_dim=abc"], ["data.batch_size=0"], ["model.num_classes=0"], ["data.input_shape=[a,b]"],
    ["model.hidden_dmi=3"], ["+model.extra=1"], ["data.batchsize=8"],
    ["trainer.max_steps=-5"], ["trainer.check_val_every_n_epoch=0"], ["trainer.val_check_interval=-1"],
    ["trainer.limit_train_batches=-1"], ["trainer.limit_val_batches=1.5"], ["trainer.accelerator=cpuu"],
    ["trainer.accelerator=gpu"], ["trainer.devices=[0,1]"], ["trainer.devices=0"], ["trainer.num_nodes=0"],
    ["trainer.gradient_clip_val=-1"], ["trainer.profiler=simpel"], ["trainer.fast_dev_run=-1"],
    ["trainer.max_restarts=-1"], ["trainer.max_restarts=1"],  # restarts of one process, which runs in the command
    ["strategy=[amp]", "strategy.amp.init_loss_scaling=inf"], ["strategy=[dgc]", "strategy.dgc.sparsity=[0.5,nan]"],
    ["strategy=[[amp]]"], ["strategy=[amp"], ["strategy=[ampp]"], ["strategy=[lars,lamb]"],
    ["name=${now:}"], ["name=${oops}"], ["model.hidden_dim=${data.nope}"], ["trainer.max_steps"], ["=3"],
    ["trainer.max_steps==3"], ["parameter_server.mode=async"],
    ["parameter_server.mode=geo"], ["collective.fuse_grad_size_in_MB=0"], ["seed=abc"], ["ckpt_path=nosuch.ckpt"],
    # what only constructing the optimizer, Lightning's Trainer or a batch would have refused, in the ranks
    ["model.optimizer.lr=-1"], ["model.optimizer.lr=abc"], ["model.optimizer.momentum=-0.5"],
    ["trainer.max_time=1:2"], ["trainer.max_time={hour:1}"], ["trainer.accelerator=mps"], ["trainer.accelerator=tpu"],
    ["trainer.devices=true"], ["trainer.enable_progress_bar=1"], ["model._target_=torch.nn.Linear"],
    ["data._target_=runner.models.MLPClassifier"], ["model._target_=collections.OrderedDict"], ["model=gpt"],
    ["model=resnet"], ["logger=wandb"], ["logger=mlflow"], ["--cgf", "job"], ["-x"], ["--cfg"],
    # pipelines the model or torch's schedules cannot run: more stages than blocks, ZBV on gloo, clipping
    ["strategy=[pipeline]", "trainer.devices=2", "strategy.pipeline.schedule_mode=Interleaved1F1B",
     "strategy.pipeline.vpp_degree=2"],
    ["strategy=[pipeline]", "trainer.devices=2", "strategy.pipeline.schedule_mode=ZBVZeroBubble",
     "strategy.pipeline.vpp_degree=2"],
    ["strategy=[pipeline]", "trainer.devices=2", "trainer.gradient_clip_val=1.0"],
    ["strategy=[pipeline]", "trainer.devices=2", "evaluate=true", "ckpt_path=last"],
    # a knob of a strategy only the sweep selects, which Hydra's sweep config cannot hold
    ["-m", "strategy=[amp,recompute],[amp,lars]", "strategy.amp.dtype=bfloat16"],
]


def knob_nodes() -> Iterator[Tuple[str, type, List[str]]]:
    """(key prefix, dataclass, the overrides that make the node exist) of every knob node."""
    for name, cls in strategies.schemas().items():
        yield f"strategy.{name}", cls, [f"strategy=[{name}]"]
    yield from [("trainer", schema.TrainerConfig, []), ("measure", schema.MeasureConfig, []),
                ("collective", collective.CollectiveConfig, []),
                ("collective.build_strategy", collective.BuildStrategyConfig, []),
                ("collective.execution_strategy", collective.ExecutionStrategyConfig, []),
                ("parameter_server", collective.ParameterServerConfig, [])]


def wrong_values(hint: Any) -> List[str]:
    """Values no knob of this type takes."""
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)] or [hint]
    if arms == [bool]:
        return ["maybe", "1"]
    if arms == [int]:
        return ["abc", "1.5"]
    if arms == [float]:
        return ["abc", "inf", "nan"]
    if typing.get_origin(arms[0]) in (list, tuple):
        return ["{a:1}"]
    return []  # str and Any take any value: their checks are by hand above


def generated() -> Iterator[Tuple[str, List[str]]]:
    for prefix, cls, selection in knob_nodes():
        hints = typing.get_type_hints(cls)
        for field in fields(cls):
            if field.name not in hints or field.name.startswith("_") or cls is collective.CollectiveConfig and \
                    field.name in ("build_strategy", "execution_strategy"):
                continue
            key = f"{prefix}.{field.name}"
            for value in wrong_values(hints[field.name]):
                yield f"{key}={value}", [*selection, f"{key}={value}"]
            yield f"{key} typo", [*selection, f"{prefix}.{field.name[:-1]}x=1"]
        if selection:  # a knob of a strategy that is not selected, in every override form
            knob = f"{prefix}.{fields(cls)[0].name}"
            for form in (f"{knob}=1", f"+{knob}=1", f"++{knob}=1", f"~{knob}", f"+{prefix}.x=1"):
                yield f"{prefix} unselected {form}", [form]
    for group, option in GROUPS.items():
        yield f"{group}={option}x", [f"{group}={option}x"]
    for overrides in BY_HAND:
        yield " ".join(overrides), overrides


CASES = list(generated())
# Run directories that are a file, lie under a file or inside another run, or cannot be made.
PATHS = {"a file": "taken", "under a file": "taken/run", "inside a run": "done/inner", "unmakeable": "/proc/lightfleet"}


def refusal(args: List[str], tmp_path, monkeypatch, capsys) -> str:
    """The one stderr line of `lightfleet ARGS`, which must exit 2 with no traceback."""
    monkeypatch.chdir(tmp_path)
    # main moves the working directory last on the path and sets the environment of what it starts
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv(USER_DIR, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightfleet: ") and "Traceback" not in err, err
    assert "'?'" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("overrides", [case for _, case in CASES], ids=[name for name, _ in CASES])
def test_a_bad_command_line_is_one_line_exit_2_and_creates_nothing(overrides, tmp_path, monkeypatch, capsys):
    refusal([*overrides, "dry_run=true"], tmp_path, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", PATHS.values(), ids=list(PATHS))
def test_a_bad_run_directory_is_refused_before_anything_is_written(path, tmp_path, monkeypatch, capsys):
    (tmp_path / "taken").write_text("a file\n")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "plan.yaml").write_text("strategies: []\n")
    line = refusal([f"paths.output_dir={path}"], tmp_path, monkeypatch, capsys)
    assert line.startswith(f"lightfleet: error: paths.output_dir='{Path(path) if path.startswith('/') else tmp_path / path}'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "taken"]
    assert [p.name for p in (tmp_path / "done").iterdir()] == ["plan.yaml"]


@pytest.mark.parametrize("overrides, key", [
    (["paths.output_dir="], "paths.output_dir=''"),
    (["-m", "seed=1,2", "paths.sweep_dir="], "paths.sweep_dir=''"),
    (["callbacks.model_checkpoint.dirpath=taken"], "callbacks.model_checkpoint.dirpath='taken'"),
])
def test_a_directory_a_run_cannot_write_is_refused_before_anything_is_written(overrides, key, tmp_path, monkeypatch,
                                                                             capsys):
    (tmp_path / "taken").write_text("a file\n")
    assert refusal(overrides, tmp_path, monkeypatch, capsys).startswith(f"lightfleet: error: {key}")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_the_generated_lines_are_a_few_hundred():
    assert len(CASES) >= 250


# Config files of the user's that PyYAML cannot read (issue 40 item 6): a tab, an unclosed list, and
# one selected from another file's defaults list. The line names the selection, file, line and column.
BAD_YAML = {
    "model/tabbed.yaml": "_target_: runner.models.MLPClassifier\nhidden_dim: 16\n\tnum_classes: 4\n",
    "experiment/unclosed.yaml": "# @package _global_\ntrainer:\n  max_steps: [1\n",
    "experiment/selects_tabbed.yaml": "# @package _global_\ndefaults:\n  - override /model: tabbed\n",
    "primary.yaml": "defaults:\n  - lightfleet\n  - _self_\nname: [\n",
}


@pytest.mark.parametrize("selection, message", [
    (["model=tabbed"], "model='tabbed': {dir}/model/tabbed.yaml, line 3, column 1: found character '\\t' that cannot "
                       "start any token (YAML indents with spaces, not tabs)"),
    (["experiment=unclosed"], "experiment='unclosed': {dir}/experiment/unclosed.yaml, line 4, column 1: expected ',' "
                              "or ']', but got '<stream end>', while parsing a flow sequence from line 3"),
    (["experiment=selects_tabbed"], "model='tabbed': {dir}/model/tabbed.yaml, line 3"),
    (["-m", "experiment=quickstart,unclosed"], "experiment='unclosed': {dir}/experiment/unclosed.yaml, line 4"),
    (["-cn", "primary"], "--config-name='primary': {dir}/primary.yaml, line 5, column 1: "),
], ids=["tab", "unclosed", "through_defaults", "in_a_sweep", "primary"])
def test_a_config_file_that_is_not_yaml_is_one_line_naming_file_and_line(selection, message, tmp_path, monkeypatch,
                                                                         capsys):
    configs = tmp_path / "configs"
    for name, text in BAD_YAML.items():
        (configs / name).parent.mkdir(parents=True, exist_ok=True)
        (configs / name).write_text(text)
    line = refusal(["--config-dir", "configs", *selection], tmp_path, monkeypatch, capsys)
    assert line.startswith("lightfleet: error: " + message.format(dir=configs)), line
    assert [p.name for p in tmp_path.iterdir()] == ["configs"]


def test_a_run_whose_saved_config_is_damaged_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 1\n\tname: x\n")
    line = refusal(["replay", "run"], tmp_path, monkeypatch, capsys)
    assert line.startswith(f"lightfleet: error: lightfleet replay='run': {tmp_path / 'run' / 'config.yaml'}, line 2, "
                           "column 1: found character '\\t'"), line


@pytest.mark.parametrize("overrides, message", [
    (["ckpt_path=run/checkpoints/epoch=3-step=50.ckpt"],  # Lightning's own file name, as typed
     "ckpt_path='run/checkpoints/epoch=3-step=50.ckpt': no such checkpoint ({tmp}/run/checkpoints/epoch=3-step=50.ckpt)"),
    (["callbacks.model_checkpoint.every_n_train_steps=50"],
     "callbacks.model_checkpoint.every_n_train_steps: callbacks.model_checkpoint has no key 'every_n_train_steps'; to "
     "pass an argument its config leaves out, add it with +callbacks.model_checkpoint.every_n_train_steps=50"),
], ids=["lightning_checkpoint_name", "needs_plus"])
def test_documented_forms_are_taken_as_typed_or_told_how_to_write_them(overrides, message, tmp_path, monkeypatch,
                                                                       capsys):
    """Issue 40 item 7: the checkpoint name reaches the checkpoint check (not Hydra's `mismatched
    input '='`); a key the config leaves out says that `+` adds it."""
    line = refusal([*overrides, "dry_run=true"], tmp_path, monkeypatch, capsys)
    assert line == "lightfleet: error: " + message.format(tmp=tmp_path)


def test_an_optuna_storage_the_installed_optuna_cannot_open_is_one_line(tmp_path, monkeypatch, capsys):
    # optuna 2.10 (hydra-optuna-sweeper 1.3's) on SQLAlchemy 2 (constraints.txt) fails its schema check
    # with a bare AssertionError: refused before the sweep, with the versions, and no database left.
    line = refusal(["-m", "hydra/sweeper=optuna", "hydra.sweeper.storage=sqlite:///study.db",
                    "model.hidden_dim=choice(16,32)", "hydra.sweep.dir=sweep"], tmp_path, monkeypatch, capsys)
    assert re.fullmatch(r"lightfleet: error: hydra.sweeper.storage='sqlite:///study.db': optuna [\d.]+ cannot open "
                        r"it with SQLAlchemy [\d.]+ \(AssertionError\); leave it unset for a study in memory", line)
    assert list(tmp_path.iterdir()) == []
