"""PaddlePaddle itself as the reference of Fleet's behaviour. The scripts in tests/paddle/ run
under Paddle in a subprocess of the test, so that no test process imports Paddle beside torch;
each says what it reads and writes. Paddle missing is a failure, not a skip: it is in the dev extra.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "paddle"  # tests/paddle/


def run_paddle(script: str, *args: str, timeout: float = 300) -> str:
    """Run tests/paddle/SCRIPT.py with `args` under Paddle; its stdout."""
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
