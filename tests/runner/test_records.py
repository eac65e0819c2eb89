"""Run directories, reserved before Hydra makes them: clock-named ones never collide, user-named
ones are never overwritten, and hydra.run.dir and paths.output_dir are one setting. The
checkpoint a run starts from: `ckpt_path=last` takes the newest run of the same experiment and
model under paths.root_dir and says which; one that does not fit the model is refused."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hydra.types import RunMode
from pytorch_lightning import LightningModule

from runner.config.compose import compose_config
from runner.core.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier
from runner.records.run_dir import check_weights_fit, checkpoint_contents, find_checkpoint, reserve_dir, take_over


def reserve(*overrides: str, sweep: bool = False, subdir: str = ""):
    cfg = compose_config(list(overrides), run_mode=RunMode.MULTIRUN if sweep else RunMode.RUN, with_hydra=True)
    keys = ("hydra.sweep.dir", "paths.sweep_dir") if sweep else ("hydra.run.dir", "paths.output_dir")
    return reserve_dir(cfg, *keys, subdir)


def test_runs_named_by_the_clock_in_the_same_second_get_their_own_directories(tmp_path):
    template = f"paths.output_dir={tmp_path}/runs/${{now:%Y}}"  # one name for the whole year: a collision
    first, second, third = (reserve(template) for _ in range(3))
    assert [p.name for p in (first, second, third)] == [first.name, f"{first.name}-1", f"{first.name}-2"]
    assert all(p.is_dir() for p in (first, second, third))


def test_sweeps_named_by_the_clock_get_their_own_directories(tmp_path):
    template = f"paths.sweep_dir={tmp_path}/sweeps/${{now:%Y}}"
    first, second = (reserve(template, sweep=True) for _ in range(2))
    assert second.name == f"{first.name}-1" and first.is_dir() and second.is_dir()


def test_a_directory_the_user_named_is_never_reused(tmp_path):
    mine = tmp_path / "mine"
    assert reserve(f"paths.output_dir={mine}") == mine
    (mine / "config.yaml").write_text("earlier run\n")
    for override in (f"paths.output_dir={mine}", f"hydra.run.dir={mine}"):
        with pytest.raises(ConfigError, match="already holds a run"):
            reserve(override)
    assert (mine / "config.yaml").read_text() == "earlier run\n"


def test_a_directory_is_taken_by_one_command_and_each_node_takes_its_own_records(tmp_path):
    """The claim is the directory plus the node's (or rank's) record subdirectory."""
    shared = tmp_path / "shared"
    assert reserve(f"paths.output_dir={shared}") == shared
    owner = yaml.safe_load((shared / "owner.yaml").read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == platform.node()
    for subdir in ("", "nodes/1"):
        if subdir:
            assert reserve(f"paths.output_dir={shared}", subdir=subdir) == shared  # node 1 beside node 0
        with pytest.raises(ConfigError, match=rf"is held by another command \(pid {os.getpid()} on "):
            reserve(f"paths.output_dir={shared}", subdir=subdir)
    assert (shared / "nodes" / "1" / "owner.yaml").is_file()
    assert sorted(p.name for p in shared.rglob("*") if p.is_file()) == ["owner.yaml", "owner.yaml"]  # no temporary left
    swept = tmp_path / "swept"
    reserve(f"paths.sweep_dir={swept}", sweep=True)
    with pytest.raises(ConfigError, match=r"paths.sweep_dir=.*is held by another command"):
        reserve(f"paths.sweep_dir={swept}", sweep=True)


def test_a_directory_whose_holder_died_before_recording_a_run_says_which_file_frees_it(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / "left"
    left.mkdir()
    (left / "owner.yaml").write_text(yaml.safe_dump({"pid": int(gone.stdout), "host": platform.node(),
                                                      "since": "2026-01-01 00:00:00 UTC", "command": "lightfleet"}))
    with pytest.raises(ConfigError, match=rf"which is no longer running and recorded no run or sweep there; choose "
                                          rf"another directory, or remove {left / 'owner.yaml'} to use this one$"):
        reserve(f"paths.output_dir={left}")
    (left / "owner.yaml").write_text("")  # a holder killed between creating its claim and writing it
    with pytest.raises(ConfigError, match=rf"is held by another command \(one that left {left / 'owner.yaml'} empty\)"):
        reserve(f"paths.output_dir={left}")
    (left / "owner.yaml").unlink()
    assert reserve(f"paths.output_dir={left}") == left


def test_a_stopped_sweep_is_taken_over_to_continue_it_only_once_its_holder_has_ended(tmp_path):
    owner = tmp_path / "owner.yaml"
    owner.write_text(yaml.safe_dump({"pid": os.getpid(), "host": platform.node(), "command": "lightfleet -m seed=1,2"}))
    with pytest.raises(ConfigError, match=rf"is held by a command still running \(pid {os.getpid()}: lightfleet -m "):
        take_over("lightfleet resume", tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner.write_text(yaml.safe_dump({"pid": int(gone.stdout), "host": platform.node(), "command": "lightfleet"}))
    take_over("lightfleet resume", tmp_path)
    assert yaml.safe_load(owner.read_text())["pid"] == os.getpid()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["owner.yaml"]  # the old claim renamed away and gone
    owner.unlink()  # a sweep from before lightfleet claimed directories: taken as a new one
    take_over("lightfleet resume", tmp_path)
    assert owner.is_file()


def test_hydra_run_dir_is_the_same_setting_as_paths_output_dir(tmp_path):
    assert reserve(f"hydra.run.dir={tmp_path}/a") == tmp_path / "a"  # follows the clock default no more
    with pytest.raises(ConfigError, match=r"hydra.run.dir=.*differs from paths.output_dir=.*set one of them"):
        reserve(f"hydra.run.dir={tmp_path}/a", f"paths.output_dir={tmp_path}/b")
    with pytest.raises(ConfigError, match=r"hydra.sweep.dir=.*differs from paths.sweep_dir"):
        reserve(f"hydra.sweep.dir={tmp_path}/a", f"paths.sweep_dir={tmp_path}/b", sweep=True)


def saved_run(records: Path, name: str, model: LightningModule, step: int, age_s: float) -> Path:
    """A run directory as far as `ckpt_path=last` reads one: its config's experiment name and model,
    and checkpoints/last.ckpt as Lightning saves it (weights, global step), written `age_s` ago."""
    (records / "checkpoints").mkdir(parents=True)
    target = f"{type(model).__module__}.{type(model).__name__}"
    (records / "config.yaml").write_text(yaml.safe_dump({"name": name, "model": {"_target_": target}}))
    checkpoint = records / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": model.state_dict(), "global_step": step}, checkpoint)
    written = time.time() - age_s
    os.utime(checkpoint, (written, written))
    return checkpoint


def test_ckpt_path_last_takes_the_newest_run_of_the_same_experiment_and_model_under_root_dir(tmp_path, capsys):
    mlp, gpt = MLPClassifier(), GPTDecoder()
    saved_run(tmp_path / "outputs" / "old", "quickstart", mlp, step=10, age_s=400)
    newest = saved_run(tmp_path / "outputs" / "new", "quickstart", mlp, step=20, age_s=300)
    saved_run(tmp_path / "multirun" / "sweep" / "0", "quickstart", gpt, step=30, age_s=200)  # another model
    saved_run(tmp_path / "outputs" / "other", "default", mlp, step=40, age_s=100)  # another experiment
    elsewhere = saved_run(tmp_path / "elsewhere" / "outputs" / "run", "quickstart", mlp, step=5, age_s=500)

    def last(*overrides: str) -> Path:
        return find_checkpoint(compose_config(["experiment=quickstart", "ckpt_path=last", *overrides]), tmp_path)

    assert last() == newest
    assert capsys.readouterr().out == f"lightfleet: ckpt_path=last: {newest} (step 20)\n"  # which run, in one line
    assert last("model=gpt", "data=language_model") == tmp_path / "multirun" / "sweep" / "0" / "checkpoints" / "last.ckpt"
    assert last("paths.root_dir=elsewhere") == elsewhere  # only under paths.root_dir, older or not
    with pytest.raises(ConfigError, match=r"^ckpt_path='last': no run of experiment 'mine' with model "
                                          r"runner.models.MLPClassifier under .* has checkpoints/last.ckpt \(only of "
                                          r"other experiments or models: 4\); give the checkpoint's path$"):
        last("name=mine")


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_it_and_the_first_keys(tmp_path):
    checkpoint = saved_run(tmp_path / "run", "default", MLPClassifier(), step=3, age_s=0)
    with torch.device("meta"):  # as the preflight builds the model
        same, narrower, gpt = MLPClassifier(), MLPClassifier(hidden_dim=32, num_blocks=1), GPTDecoder()
    check_weights_fit(checkpoint, checkpoint_contents(checkpoint), same)
    with pytest.raises(ConfigError) as refused:
        check_weights_fit(checkpoint, checkpoint_contents(checkpoint), gpt)
    gpt_keys, mlp_keys = list(gpt.state_dict()), list(same.state_dict())
    assert str(refused.value) == (
        f"ckpt_path='{checkpoint}': its weights do not fit the model (GPTDecoder): "
        f"missing: {', '.join(gpt_keys[:3])} (+{len(gpt_keys) - 3} more); "
        f"unexpected: {', '.join(mlp_keys[:3])} (+{len(mlp_keys) - 3} more)")
    with pytest.raises(ConfigError, match=r"\(MLPClassifier\): unexpected: blocks.1.net.0.weight, blocks.1.net.0.bias, "
                                          r"blocks.1.net.1.weight \(\+9 more\); other shapes: stem.weight \[64, 32\] "
                                          r"\(model \[32, 32\]\), stem.bias \[64\] \(model \[32\]\), "):
        check_weights_fit(checkpoint, checkpoint_contents(checkpoint), narrower)


@pytest.mark.slow
def test_the_command_says_which_run_it_continues_and_refuses_a_checkpoint_of_another_model(lightfleet, tmp_path):
    newest = saved_run(tmp_path / "outputs" / "run", "quickstart", MLPClassifier(), step=7, age_s=0)
    shown = lightfleet("experiment=quickstart", "ckpt_path=last", "dry_run=true")
    assert shown.returncode == 0 and f"lightfleet: ckpt_path=last: {newest} (step 7)\n" in shown.stdout
    gpt = ("experiment=quickstart", "model=gpt", "data=language_model")
    for command, refusal in (
            ([*gpt, "ckpt_path=last"], "ckpt_path='last': no run of experiment 'quickstart' with model "
                                      "runner.models.GPTDecoder under "),
            ([*gpt, f"ckpt_path={newest}"], f"ckpt_path='{newest}': its weights do not fit the model (GPTDecoder): "
                                            f"missing: token_embedding.weight, ")):
        done = lightfleet(*command)
        assert done.returncode == 2 and done.stderr.startswith(f"lightfleet: error: {refusal}"), done.stderr
        assert len(done.stderr.splitlines()) == 1 and done.stdout == ""
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outputs"]  # nothing made
