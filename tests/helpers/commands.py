"""The environment of the processes the tests start (the real command, 2-process torch runs, the
command a test signals): the project's root first on PYTHONPATH, so that every process imports
runner/, plugins/ and the tests' helpers (`tests.helpers.*`, the callbacks runs load by name)
whatever its working directory; and none of a launcher's rank variables, which would make a
process the test starts take itself for a rank."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "SLURM_PROCID")


def command_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a process the test starts, with `extra` set."""
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(paths)}
    for var in LAUNCHER_VARIABLES:
        env.pop(var, None)
    return env
