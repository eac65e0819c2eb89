"""A signal to a sweep's command stops every job it started, in every launcher, and the sweep
continues later: under joblib (whose loky workers a signal to the command never reached: they were
re-parented to init and trained on) and under the basic launcher, SIGTERM to the command makes the
running jobs checkpoint and end, leaves no process of the sweep alive 30 s later, and sweep.yaml
lists every job the sweeper planned with its state; `lightfleet resume SWEEP_DIR` then finishes the
stopped jobs from their checkpoints and starts the others, keeping what finished."""
from __future__ import annotations

import signal
import time

import pytest
import torch
import yaml

from runner.rank.parent import PREEMPTED
from tests.helpers.preemption import REACHED, process_tree, start, wait_for, wait_gone

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


def read(path):
    return yaml.safe_load(path.read_text())


def stop(process, sweep, running):
    """SIGTERM to the command once `running` jobs train; its console, once every process that was
    below it is gone (within 30 s of the signal)."""
    for job in running:
        wait_for(sweep / job / REACHED, process)
    tree = process_tree(process.pid)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    wait_gone(tree, within=30 - (time.monotonic() - signalled))
    assert process.returncode == PREEMPTED and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].endswith(f"; continue with: lightfleet resume {sweep}"), err[-3000:]
    return out, err, tree


def step_of(checkpoint):
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"]


def test_sigterm_to_a_joblib_sweep_stops_its_workers_and_resume_finishes_it(lightfleet, tmp_path):
    process = start(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1,2", "paths.sweep_dir=sweep",
                    multirun=True)
    sweep = tmp_path / "sweep"
    out, err, tree = stop(process, sweep, running=["0", "1"])
    assert len(tree) >= 4  # the 2 loky workers and their resource trackers, at least
    assert err.strip().splitlines()[-1].startswith("lightfleet: sweep stopped by SIGTERM: 2 preempted, 1 not started;")
    jobs = read(sweep / "sweep.yaml")["jobs"]
    assert {name: job["status"] for name, job in jobs.items()} == {"0": "preempted", "1": "preempted",
                                                                   "2": "not_started"}
    assert "seed=2" in jobs["2"]["overrides"]
    steps = {job: step_of(sweep / job / "checkpoints" / "last.ckpt") for job in ("0", "1")}
    assert all(3 <= step < 40 for step in steps.values()), steps
    assert not (sweep / "2").exists()
    assert "Missing results: jobs 0, 1, 2" in out  # the report says what is missing

    resumed = lightfleet("resume", "sweep")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    jobs = read(sweep / "sweep.yaml")["jobs"]
    assert {name: job["status"] for name, job in jobs.items()} == {"0": "finished", "1": "finished", "2": "finished"}
    for job in ("0", "1", "2"):
        assert read(sweep / job / "results.yaml")["global_step"] == 40
        assert read(sweep / job / "config.yaml")["seed"] == int(job)
    for job, step in steps.items():  # the stopped attempts, kept aside, are where they continued from
        assert read(sweep / job / "config.yaml")["ckpt_path"] == str(sweep / ".attempts" / f"{job}.1" / "checkpoints"
                                                                   / "last.ckpt")
        assert f"lightfleet: continuing from step {step}" in resumed.stdout
    assert read(sweep / "2" / "config.yaml")["ckpt_path"] is None
    assert "Missing results" not in resumed.stdout


def test_sigterm_to_a_basic_sweep_lists_the_jobs_not_started_and_resume_finishes_it(lightfleet, tmp_path):
    process = start(tmp_path, "trainer.devices=1,2", "paths.sweep_dir=sweep", multirun=True)
    sweep = tmp_path / "sweep"
    out, err, tree = stop(process, sweep, running=["0"])
    jobs = read(sweep / "sweep.yaml")["jobs"]
    assert {name: job["status"] for name, job in jobs.items()} == {"0": "preempted", "1": "not_started"}
    assert "continue with: lightfleet resume" in jobs["0"]["error"]
    assert "trainer.devices=2" in jobs["1"]["overrides"]
    step = step_of(sweep / "0" / "checkpoints" / "last.ckpt")

    resumed = lightfleet("resume", str(sweep))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"lightfleet: continuing from step {step}" in resumed.stdout
    jobs = read(sweep / "sweep.yaml")["jobs"]
    assert {name: job["status"] for name, job in jobs.items()} == {"0": "finished", "1": "finished"}
    assert [read(sweep / job / "results.yaml")["global_step"] for job in ("0", "1")] == [40, 40]
    assert len(list((sweep / "1").glob("logs/*/attempt_0/*/stderr.log"))) == 2  # job 1 ran its 2 processes

    again = lightfleet("resume", str(sweep))  # nothing left to do: the finished jobs are kept
    assert again.returncode == 0 and "nothing to continue" in again.stdout, again.stderr[-3000:]


@pytest.mark.parametrize("study, says", [
    ((), "its Optuna study was kept in memory and ended with its command, so the sweep cannot continue: run it "
         "again (with hydra.sweeper.storage and hydra.sweeper.study_name its study would persist)"),
    (("hydra.sweeper.storage=sqlite:///study.db", "hydra.sweeper.study_name=lr"),
     "an Optuna sweep continues through its study, not job by job: run its command line again into a new sweep "
     "directory, with the same hydra.sweeper.storage and hydra.sweeper.study_name=lr")], ids=["in_memory", "stored"])
def test_resume_of_an_optuna_sweep_says_how_it_continues(tmp_path, monkeypatch, capsys, study, says):
    """An Optuna sweep chooses its trials as it goes: not continued job by job; one line, nothing run."""
    from runner.command import cli

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.yaml").write_text(yaml.safe_dump({"command": [
        "-m", "hydra/sweeper=optuna", *study, "model.hidden_dim=choice(16,32)", f"hydra.sweep.dir='{sweep}'"],
        "cwd": str(tmp_path), "jobs": {}}))
    with pytest.raises(SystemExit) as refused:
        cli.main(["resume", str(sweep)])
    assert refused.value.code == 2
    assert capsys.readouterr().err == f"lightfleet: error: lightfleet resume='{sweep}': {says}\n"
    assert sorted(path.name for path in sweep.iterdir()) == ["sweep.yaml"]
