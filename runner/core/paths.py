"""Where lightfleet's own files are: its folders of configs, conf/ and experiments/.
Pure: every layer may ask (the compatibility table, Hydra's search path, the run's records of the
code's version).

The configs stand at the top of a checkout (the project's shape); a wheel holds only packages,
so pyproject.toml installs them inside the runner package, as runner/conf and runner/experiments.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # runner/
# Where runner/ and plugins/ are imported from: a checkout's root, or site-packages once installed.
IMPORT_ROOT = PACKAGE_DIR.parent


def config_folder(name: str, package_dir: Path = PACKAGE_DIR) -> Path:
    """lightfleet's folder of configs `name`: inside the installed package, else the checkout's
    (a checkout's runner/ has no such folder: an editable install maps it, it copies nothing)."""
    installed = package_dir / name
    return installed if installed.is_dir() else package_dir.parent / name


CONF_DIR = config_folder("conf")
EXPERIMENTS_DIR = config_folder("experiments")
# The checkout lightfleet runs from (its git commit is the code's version), or None once installed.
CHECKOUT: Optional[Path] = None if CONF_DIR.parent == PACKAGE_DIR else IMPORT_ROOT

