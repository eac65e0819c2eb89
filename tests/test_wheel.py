"""lightfleet built into a wheel and installed from it, as `pip install .` or a git URL installs it:
the wheel holds every module and every config (conf/ and experiments/ inside the runner package),
and the installed `lightfleet` command runs from any directory, one holding packages of the user's
named as lightfleet's (`plugins/`, `runner/`) beside the user's own model, in the command and in its ranks."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers.commands import PROJECT_ROOT, command_env
from tests.helpers.user_code import USER_MODEL, USER_NET, shadowing_packages

pytestmark = pytest.mark.slow  # builds a wheel, makes a virtual environment and trains in processes of its own

# What the build reads: pyproject.toml names the packages and maps conf/ and experiments/ into runner.
SOURCES = ("pyproject.toml", "README.md", "runner", "plugins", "conf", "experiments")
# Where each checkout folder lands inside the wheel.
INSTALLED_AS = {"runner": "runner", "plugins": "plugins", "conf": "runner/conf", "experiments": "runner/experiments"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Dict[str, Path]:
    """The wheel built from a copy of the checkout (no build/ of an earlier build in it, nothing downloaded),
    and a virtual environment with it installed, which takes its dependencies from this interpreter's."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        if (PROJECT_ROOT / name).is_dir():
            shutil.copytree(PROJECT_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(PROJECT_ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", "dist",
         str(source)], work)
    (wheel,) = (work / "dist").glob("lightfleet-*.whl")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], work)
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], work)
    return {"wheel": wheel, "venv": venv}


def run(command: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """`command` from `cwd`, with nothing on PYTHONPATH: the virtual environment's own lightfleet, not the
    checkout (nor this interpreter's editable install, which the environment sees after its own)."""
    done = subprocess.run(command, cwd=cwd, env={**command_env(PYTHONUNBUFFERED="1"), "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    return done


def test_the_wheel_holds_every_module_and_config(installed):
    held = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for folder, inside in INSTALLED_AS.items():
        for path in (PROJECT_ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml"):
                assert f"{inside}/{path.relative_to(PROJECT_ROOT / folder).as_posix()}" in held, path


def test_the_installed_command_runs_from_a_directory_of_the_users(installed, tmp_path):
    python = installed["venv"] / "bin" / "python"
    imported = run([str(python), "-c", "import runner; print(runner.__file__)"], tmp_path).stdout.strip()
    assert Path(imported).is_relative_to(installed["venv"]), imported
    (tmp_path / "user_model.py").write_text(USER_MODEL)
    (tmp_path / "my_configs" / "model").mkdir(parents=True)
    (tmp_path / "my_configs" / "model" / "user_net.yaml").write_text(USER_NET)
    shadowing_packages(tmp_path, "plugins", "runner")
    lightfleet = str(installed["venv"] / "bin" / "lightfleet")
    planned = run([lightfleet, "experiment=quickstart", "dry_run=true"], tmp_path)
    assert "strategies: (none)\nworld: 1 process(es)" in planned.stdout
    # Two ranks (forked from the command on a CPU) in the user's directory, training the user's model.
    done = run([lightfleet, "-cd", "my_configs", "model=user_net", "trainer.devices=2", "trainer.max_steps=2",
                "trainer.enable_progress_bar=false", "hydra.run.dir=run"], tmp_path)
    assert "lightfleet: done: 2 steps" in done.stdout, done.stdout
