"""Where lightfleet's files are (runner/core/paths.py): its configs in a checkout or inside the
installed package (a wheel: tests/test_wheel.py), and the code's version of a checkout only."""
from __future__ import annotations

import subprocess

from runner.core import paths
from runner.records import run_dir
from tests.helpers.commands import PROJECT_ROOT


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

