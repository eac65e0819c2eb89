"""A home-relative path (`~/...`) is taken wherever lightfleet takes a path: every path knob of the
config (data files and folders, the tokenizer, weights, a pretrained model, ckpt_path, paths.*,
Hydra's run and sweep directories), --config-dir and --config-path, and the arguments of the
subcommands (report, replay, resume, eval, export-fleet, import-fleet, prepare-data).

HOME is a folder of the test's and the command runs in another, so a `~` left unexpanded names
nothing there (or makes a folder called `~` in the working directory). A knob is given in both forms
a user gives it: typed (`KEY=~/x`, which no shell expands after a dotted key, and Hydra's grammar
refuses) and as a config file holds it (`KEY='~/x'`, reaching lightfleet's code as typed)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from runner.command import cli, preflight
from runner.config.compose import CONFIG_NAME
from runner.core.paths import CONF_DIR, USER_DIR, home_expanded
from runner.fleet.export_fleet import export_fleet
from runner.models.causal_lm import CausalLM
from tests.helpers.data_files import field_files, gpt2_on_tokens, gpt2_on_text, resnet_on_images

HOME = Path("~")
QUICK_RUN = "~/runs/outputs/quick"  # made by the real command, `hydra.run.dir=~/runs/outputs/quick`


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home directory holding what the paths name: the field's data files, a tokenizer, torchvision
    weights, a saved transformers model, a config directory."""
    home = tmp_path_factory.mktemp("home")
    field_files((home / "f").mkdir() or home / "f")
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), home / "resnet18.pt")
    CausalLM(vocab_size=128, seq_len=32, d_model=32, n_layers=1, n_heads=2).lm.save_pretrained(home / "pretrained")
    (home / "cfg" / "model").mkdir(parents=True)
    shutil.copy(CONF_DIR / "model" / "mlp.yaml", home / "cfg" / "model" / "mine.yaml")
    return home


@pytest.fixture(scope="module")
def home_run(home, lightfleet_in, tmp_path_factory) -> Path:
    """`home`, with a run the real command made in ~/runs/outputs/quick (typed, unquoted), and a
    Fleet strategy file."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        done = lightfleet_in(tmp_path_factory.mktemp("elsewhere"), "experiment=quickstart", "trainer.max_steps=2",
                             f"hydra.run.dir={QUICK_RUN}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (home / "runs" / "outputs" / "quick" / "checkpoints" / "last.ckpt").is_file()
    export_fleet(home / "runs" / "outputs" / "quick", home / "fleet.prototxt")
    return home


@pytest.fixture
def elsewhere(home, tmp_path, monkeypatch) -> Path:
    """HOME set to `home`, the working directory another folder; as test_bad_input runs the command in process."""
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv(USER_DIR, raising=False)
    yield tmp_path
    assert not (tmp_path / "~").exists(), "a `~` was taken as a folder's name"


def as_in_a_file(args: List[str]) -> List[str]:
    """`KEY=~/x` as a config file gives it: quoted for Hydra, reaching lightfleet's code unexpanded."""
    return [f"{key}='{value}'" if value.startswith("~") and not key.startswith("-") else arg
            for arg, (key, _, value) in ((arg, arg.partition("=")) for arg in args)]


def in_process(args: List[str], capsys) -> str:
    """`lightfleet ARGS` in this process: its stdout; it must succeed."""
    try:
        code = cli.main(args)
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return out.out


# Knobs the preflight reads, checked in a dry run: what each names must be found under HOME.
KNOBS = {
    "data.train_bin+data.val_bin": gpt2_on_tokens(HOME / "f"),
    "data.root": resnet_on_images(HOME / "f"),
    "data.path+data.tokenizer": gpt2_on_text(HOME / "f"),
    "model.weights_path": [*resnet_on_images(HOME / "f"), "model.weights_path=~/resnet18.pt"],
    "model.pretrained_path": [*gpt2_on_tokens(HOME / "f"), "model.pretrained_path=~/pretrained"],
    "--config-dir": ["--config-dir", "~/cfg", "model=mine"],  # a flag's quoted argument reaches it as typed
    "--config-path=": ["--config-path=~/cfg", "model=mine"],
}


@pytest.mark.parametrize("form", [list, as_in_a_file], ids=["typed", "in_a_file"])
@pytest.mark.parametrize("knob", list(KNOBS))
def test_a_path_knob_takes_a_home_relative_path(knob, form, elsewhere, capsys):
    assert "strategies:" in in_process(form([*KNOBS[knob], "dry_run=true"]), capsys)


def test_each_item_of_a_swept_path_takes_a_home_relative_path(elsewhere, capsys):
    images = [arg for arg in resnet_on_images(HOME / "f") if not arg.startswith("data.root=")]
    shown = in_process(["-m", *images, "data.root=~/f/images,~/f/images", "dry_run=true"], capsys)
    assert shown.count("--- job ") == 2 and shown.count("strategies:") == 2, shown


# Directories a run or sweep is given: each must be reserved under HOME.
DIRECTORIES = {
    "hydra.run.dir": (["hydra.run.dir=~/r1"], "r1"),
    "paths.output_dir": (["paths.output_dir=~/r2"], "r2"),
    "paths.root_dir": (["paths.root_dir=~/r3"], "r3/outputs"),
    "hydra.sweep.dir": (["hydra.sweep.dir=~/s1", "seed=1,2"], "s1"),
    "paths.sweep_dir": (["paths.sweep_dir=~/s2", "seed=1,2"], "s2"),
    "paths.root_dir-swept": (["paths.root_dir=~/s3", "seed=1,2"], "s3/multirun"),
}


@pytest.mark.parametrize("form", [list, as_in_a_file], ids=["typed", "in_a_file"])
@pytest.mark.parametrize("directory", list(DIRECTORIES))
def test_a_run_or_sweep_directory_takes_a_home_relative_path(directory, form, home, elsewhere):
    args, under = DIRECTORIES[directory]
    tag = f"{form.__name__}-"  # a directory per form: reserving it makes it the first command's for good
    args, under = [arg.replace("=~/", f"=~/{tag}") for arg in args], tag + under
    overrides = [home_expanded(arg) for arg in form(args)]  # as the command takes its arguments
    sweep = any("," in arg for arg in overrides)
    cfg = preflight.compose(overrides, None, CONFIG_NAME, multirun=sweep)
    reserved = (preflight.sweep_directory(cfg) if sweep else
                preflight.run_directory(cfg, preflight.check_job(cfg).plan)[0])
    assert reserved.is_relative_to(home / under), reserved


def test_prepare_data_takes_home_relative_paths(home, elsewhere, capsys):
    in_process(["prepare-data", "--tokenizer", "~/f/tokenizer.json", "-o", "~/prep", "~/f/corpus"], capsys)
    assert (home / "prep" / "train.bin").is_file()


def test_help_lists_the_options_of_a_home_relative_config_dir(home, elsewhere, capsys):
    assert "mine" in in_process(["--config-dir", "~/cfg", "--help"], capsys)


# What takes the run the real command made: the argument, or the knob, and what it must write under HOME.
WITH_A_RUN = {
    "ckpt_path": ([f"ckpt_path={QUICK_RUN}/checkpoints/last.ckpt", "experiment=quickstart", "trainer.max_steps=4",
                   "dry_run=true"], None),
    "ckpt_path=last+paths.root_dir": (["paths.root_dir=~/runs", "ckpt_path=last", "experiment=quickstart",
                                        "trainer.max_steps=4", "dry_run=true"], None),
    "resume": (["resume", QUICK_RUN, "trainer.max_steps=4", "dry_run=true"], None),
    "replay": (["replay", QUICK_RUN, "dry_run=true"], None),
    "eval": (["eval", QUICK_RUN, "dry_run=true"], None),
    "report": (["report", QUICK_RUN, "--out", "~/report"], "report/report.md"),
    "export-fleet": (["export-fleet", QUICK_RUN, "-o", "~/exported.prototxt"], "exported.prototxt"),
    "import-fleet": (["import-fleet", "~/fleet.prototxt", "-o", "~/imported.yaml"], "imported.yaml"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(WITH_A_RUN))
def test_the_paths_of_a_run_take_home_relative_paths(case, home_run, elsewhere, capsys):
    args, writes = WITH_A_RUN[case]
    for form in ([list, as_in_a_file] if "=" in args[0] else [list]):  # a subcommand's arguments: as typed
        in_process(form(args), capsys)
    assert writes is None or (home_run / writes).is_file()
