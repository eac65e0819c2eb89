"""Shared fixtures: compose configs in-process, and run the real `lightfleet` command."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers import data_files
from tests.helpers.commands import command_env
from runner.config.compose import compose_config
from runner.config.checks import RunSpec, validate


def pytest_configure(config: pytest.Config) -> None:
    """The suite trains on the CPU on purpose (2 processes over gloo, wherever it runs, so a
    machine with one GPU passes it as a CPU machine does); only `-m gpu` (tests/test_gpu.py) sees
    the GPUs. Set before torch first asks CUDA, in this process and every one it starts."""
    expression = config.getoption("markexpr") or ""
    if "gpu" not in expression or "not gpu" in expression:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tests train tiny models on a shared 2-core machine: one torch thread each is as fast, and
    more threads than free cores spin-wait and slow a fit down 20x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spec_for() -> Callable[..., RunSpec]:
    """Compose and validate a config from overrides, as the CLI does."""
    return lambda *overrides: validate(compose_config(list(overrides)))


def run_command(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real command in a fresh process, from `cwd`, with stdout and stderr apart."""
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=command_env(PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def lightfleet(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run the real command in a fresh process, from `tmp_path`, with stdout and stderr apart."""
    return functools.partial(run_command, tmp_path)


@pytest.fixture(scope="session")
def lightfleet_in() -> Callable[..., subprocess.CompletedProcess]:
    """lightfleet_in(cwd, *args): the real command from `cwd`, for fixtures wider than a test (a run
    that several tests read)."""
    return run_command



@pytest.fixture(scope="session")
def field_files(tmp_path_factory) -> Path:
    """The files the field's models train on (tests/helpers/data_files.py:field_files), made once per test process."""
    return data_files.field_files(tmp_path_factory.mktemp("field_files"))
