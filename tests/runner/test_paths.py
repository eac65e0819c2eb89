"""Where lightfleet's files are (runner/core/paths.py): its configs in a checkout or inside the
installed package (a wheel: tests/test_wheel.py), the code's version of a checkout only, and the
user's directory on the path after lightfleet's own packages."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runner.core import paths
from runner.records import run_dir
from tests.helpers.commands import PROJECT_ROOT, command_env
from tests.helpers.user_code import shadowing_packages


def test_configs_are_found_inside_the_installed_package_else_in_the_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    for folder in ("runner", "conf", "experiments"):
        (checkout / folder).mkdir(parents=True)
    assert paths.config_folder("conf", checkout / "runner") == checkout / "conf"
    # Installed, the package's own folder, whatever else site-packages holds (another distribution's conf/).
    site = tmp_path / "site-packages"
    for folder in ("runner/conf", "runner/experiments", "conf"):
        (site / folder).mkdir(parents=True)
    assert paths.config_folder("conf", site / "runner") == site / "runner" / "conf"
    assert paths.config_folder("experiments", site / "runner") == site / "runner" / "experiments"
    assert (paths.CONF_DIR, paths.EXPERIMENTS_DIR, paths.CHECKOUT) == (
        PROJECT_ROOT / "conf", PROJECT_ROOT / "experiments", PROJECT_ROOT)


def test_the_code_version_is_the_checkouts_commit_and_none_once_installed(monkeypatch):
    head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert run_dir.git_commit().startswith(head.stdout.strip())
    # Installed into a virtual environment inside some repository: that repository's commit is not lightfleet's.
    monkeypatch.setattr(run_dir, "CHECKOUT", None)
    assert run_dir.git_commit() == "unknown"


def test_the_users_directory_comes_after_lightfleets_packages(tmp_path, monkeypatch):
    ours, user = str(paths.IMPORT_ROOT), str(tmp_path)
    monkeypatch.delenv(paths.USER_DIR, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/given", ours]))
    # `python -m runner` run from the user's directory put it first.
    monkeypatch.setattr(sys, "path", [user, ours, "/elsewhere", ""])
    paths.user_code_last(user)
    assert sys.path == [ours, "/elsewhere", user]
    # What the command starts is told where the user's code is, and finds lightfleet's checkout first.
    assert os.environ[paths.USER_DIR] == user and os.environ["PYTHONPATH"] == os.pathsep.join([ours, "/given"])
    # A rank, in the run's directory (hydra.job.chdir): the command's directory, last again.
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    monkeypatch.setattr(sys, "path", [ours, "/elsewhere"])
    paths.user_code_last()
    assert sys.path == [ours, "/elsewhere", user]
    # Run from lightfleet's own checkout, that directory is lightfleet's: it stays where it is.
    monkeypatch.setattr(sys, "path", [ours, "/elsewhere"])
    paths.user_code_last(ours)
    assert sys.path == [ours, "/elsewhere"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P came with Python 3.11")
def test_a_process_lightfleet_starts_does_not_import_the_users_runner(tmp_path):
    shadowing_packages(tmp_path, "runner")
    started = subprocess.run([*paths.python_module("runner.core.paths")], cwd=tmp_path, env=command_env(),
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr[-2000:]
