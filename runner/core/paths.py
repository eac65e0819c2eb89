"""Where lightfleet's own files are (its folders of configs, conf/ and experiments/), and where
the code of a run is imported from: lightfleet's packages first, the user's modules after them.
Pure: every layer may ask (the compatibility table, Hydra's search path, the run's records of the
code's version, the processes a command starts).

The configs stand at the top of a checkout (the project's shape); a wheel holds only packages,
so pyproject.toml installs them inside the runner package, as runner/conf and runner/experiments.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import List, Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # runner/
# Where runner/ and plugins/ are imported from: a checkout's root, or site-packages once installed.
IMPORT_ROOT = PACKAGE_DIR.parent
# The directory the command started in, for every process it starts: the user's modules are imported
# from there (a rank's working directory may be another: hydra.job.chdir).
USER_DIR = "LIGHTFLEET_USER_DIR"


def config_folder(name: str, package_dir: Path = PACKAGE_DIR) -> Path:
    """lightfleet's folder of configs `name`: inside the installed package, else the checkout's
    (a checkout's runner/ has no such folder: an editable install maps it, it copies nothing)."""
    installed = package_dir / name
    return installed if installed.is_dir() else package_dir.parent / name


CONF_DIR = config_folder("conf")
EXPERIMENTS_DIR = config_folder("experiments")
# The checkout lightfleet runs from (its git commit is the code's version), or None once installed.
CHECKOUT: Optional[Path] = None if CONF_DIR.parent == PACKAGE_DIR else IMPORT_ROOT


def user_path(typed: str) -> Path:
    """A path as the user gave it, `~` (and `~user`) expanded as a shell would: a quoted argument,
    a config file's value or an override's reach lightfleet unexpanded."""
    return Path(typed).expanduser()


# A `~` that starts an unquoted value or an item of a sweep or list (`KEY=~/a,~/b`, `[~/a]`, `choice(~/a)`).
_HOME_ITEM = re.compile(r"(?:^|(?<=[,\[(]))~[^,\])]*")


def home_expanded(override: str) -> str:
    """`KEY=~/...` as the home directory's path: Hydra's grammar has no unquoted `~` in a value, and
    a shell expands it after `=` only where KEY is a variable's name (never with a dot in it). A
    quoted value is Hydra's to read as written (the code that takes the path expands it)."""
    key, equals, value = override.partition("=")
    if not equals or "'" in value or '"' in value:
        return override
    return f"{key}={_HOME_ITEM.sub(lambda item: os.path.expanduser(item.group(0)), value)}"


def user_code_last(user_dir: Optional[str] = None) -> None:
    """The user's modules (the `_target_`s of their model and data) importable from the command's
    directory, after lightfleet's packages and everything installed, so that a `plugins/` or
    `runner/` of the user's there shadows nothing of lightfleet's (`python -m` put the working
    directory first); lightfleet's own checkout, when it is that directory, keeps its place.

    The command passes its directory: every process it starts is told it (USER_DIR) and finds
    lightfleet's checkout first on its PYTHONPATH, as it does not look in its working directory
    (python_module). Each of those processes calls this without an argument."""
    ours = str(IMPORT_ROOT)
    if user_dir is not None:
        os.environ[USER_DIR] = user_dir
        given = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry not in ("", ours)]
        os.environ["PYTHONPATH"] = os.pathsep.join([*([ours] if CHECKOUT is not None else []), *given])
    user_dir = os.environ.get(USER_DIR, os.getcwd())
    sys.path[:] = [entry for entry in sys.path if entry not in ("", user_dir) or entry == ours]
    if user_dir != ours:
        sys.path.append(user_dir)


def python_module(module: str) -> List[str]:
    """`python -m module`, for a process lightfleet starts (a rank, auto's trial), without its working
    directory first on its path, where a user's `runner/` would be imported in place of lightfleet's:
    -P, Python 3.11 and later. Python 3.10 has none: there a `runner/` of the user's still shadows
    lightfleet's in these processes, and user_code_last moves the directory last once they start."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module]
