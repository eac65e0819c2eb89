"""One flight from the command line to the ranks: a run is composed and checked once, in the command,
and its job takes that check; a sweep's jobs are checked once each, in the command, and take their
check to whatever process Hydra's launcher runs them in (joblib's workers here). Counted from
inside every process the command starts: a sitecustomize module, on the PYTHONPATH of the command
and of everything it starts, wraps Hydra's composition and lightfleet's job check."""
from __future__ import annotations

import collections
import os
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

COUNTING = textwrap.dedent('''
    import functools, os

    def counted(owner, name, what):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            with open(os.environ["LIGHTFLEET_COUNTS"], "a") as counts:
                counts.write(f"{what} {os.getpid()}\\n")
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from runner.command import preflight

    counted(ConfigLoaderImpl, "load_configuration", "compose")
    counted(preflight, "check_job", "check")
''')


@pytest.fixture
def counted(lightfleet, tmp_path, monkeypatch):
    """The lightfleet command with every composition and job check counted: a Counter of
    (what, process), the command's own process being "command"."""
    (tmp_path / "counting").mkdir()
    (tmp_path / "counting" / "sitecustomize.py").write_text(COUNTING)
    counts = tmp_path / "counts.txt"
    monkeypatch.setenv("LIGHTFLEET_COUNTS", str(counts))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "counting"),
                                                                   os.environ.get("PYTHONPATH")])))

    def run(*args: str):
        done = lightfleet(*args)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line.split() for line in counts.read_text().splitlines()]
        command = lines[0][1]  # the command composes first
        return collections.Counter((what, "command" if pid == command else "other") for what, pid in lines)

    return run


def test_a_run_of_two_processes_is_composed_and_checked_once_in_the_command(counted):
    counts = counted("trainer.devices=2", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                     "paths.output_dir=run")
    assert counts == {("compose", "command"): 1, ("check", "command"): 1}


def test_each_job_of_a_sweep_is_checked_once_also_in_joblibs_workers(counted):
    counts = counted("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1,2", "trainer.max_steps=2",
                     "trainer.enable_progress_bar=false", "paths.sweep_dir=sweep")
    jobs = 3
    assert counts[("check", "command")] == jobs and counts[("check", "other")] == 0
    # lightfleet composes the sweep and each job, to check them before anything starts (1 + jobs);
    # Hydra's application then composes the sweep twice (its mode, then the sweep) and each job
    # twice: its basic sweeper's check of the batch, in the command, and the launcher's, in the
    # worker that runs the job.
    assert counts[("compose", "command")] == (1 + jobs) + (2 + jobs) and counts[("compose", "other")] == jobs
