"""Shared fixtures: compose configs in-process, and run the real `lightfleet` command."""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers import command_server, data_files
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
    """The real command from `cwd`, with stdout and stderr apart, forked from a process that has
    imported torch and Lightning (tests/helpers/command_server.py)."""
    return command_server.run_module("runner", list(args), cwd, timeout)


@pytest.fixture
def lightfleet(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run the real command from `tmp_path`, with stdout and stderr apart (forked: see run_command)."""
    return functools.partial(run_command, tmp_path)


@pytest.fixture
def lightfleet_fresh(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run the real command in a fresh process, from `tmp_path`: for what only a fresh process
    shows, such as the warnings libraries print while they are imported."""
    return lambda *args, timeout=300: command_server.run_fresh("runner", list(args), tmp_path, timeout)


@pytest.fixture(scope="session")
def lightfleet_in() -> Callable[..., subprocess.CompletedProcess]:
    """lightfleet_in(cwd, *args): the real command from `cwd`, for fixtures wider than a test (a run
    that several tests read)."""
    return run_command



@pytest.fixture(scope="session")
def field_files(tmp_path_factory) -> Path:
    """The files the field's models train on (tests/helpers/data_files.py:field_files), made once per test process."""
    return data_files.field_files(tmp_path_factory.mktemp("field_files"))
