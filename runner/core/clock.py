"""When the command started (seconds since the epoch), handed to rank processes through the
environment: a run's start-up time (command to first step) and wall time count from it."""
from __future__ import annotations

import os
import time

STARTED_AT_ENV = "LIGHTFLEET_STARTED_AT"


def mark_start() -> None:
    """Note that the command (or a sweep's next job) starts now."""
    os.environ[STARTED_AT_ENV] = repr(time.time())


def started_at() -> float:
    return float(os.environ.get(STARTED_AT_ENV, time.time()))
