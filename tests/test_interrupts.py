"""Signals at the moments tests/test_preemption.py does not reach, through the real command: a
command killed while its ranks are still starting takes them with it; SIGTERM before the first
checkpoint says so truthfully and the printed `lightfleet resume RUN` starts the run again; Ctrl-C
(SIGINT) is handled as SIGTERM, with exit status 130; a signal in strategy=[auto]'s search ends the
trial under way with the command."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from runner.rank.parent import INTERRUPTED, PREEMPTED
from tests.helpers.preemption import REACHED, rank_pids, start, wait_for, wait_gone

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


def starting_ranks(run: Path, process: subprocess.Popen, count: int = 2) -> list:
    """The pids of the command's ranks as soon as they exist (torch's elastic agent makes the run's
    logs/ just before it starts them): still importing torch, seconds before their first step."""
    wait_for(run / "logs", process)
    while len(rank_pids(process.pid)) < count:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    return rank_pids(process.pid)


def logged_steps(run: Path) -> list:
    """The steps at which the run logged its training loss (csv/metrics.csv)."""
    with (run / "csv" / "metrics.csv").open() as rows:
        return [int(row["step"]) for row in csv.DictReader(rows) if row["train_loss"]]


def test_a_command_killed_while_its_ranks_start_takes_them_with_it(tmp_path):
    process = start(tmp_path, "trainer.devices=2", "trainer.max_steps=400", "paths.output_dir=run")
    ranks = starting_ranks(tmp_path / "run", process)
    process.kill()
    process.communicate(timeout=30)
    wait_gone(ranks, within=30)
    assert not (tmp_path / "run" / REACHED).exists()  # they never trained


def test_sigterm_while_ranks_start_says_no_checkpoint_and_resume_starts_again(lightfleet, tmp_path):
    run = tmp_path / "run"
    process = start(tmp_path, "trainer.devices=2", "trainer.max_steps=6", "paths.output_dir=run")
    starting_ranks(run, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"lightfleet: preempted by SIGTERM; no checkpoint was saved yet, so "
                                            f"resuming starts the run again; continue with: lightfleet resume {run}")
    assert not (run / "checkpoints" / "last.ckpt").exists()
    failure = yaml.safe_load((run / "failure.yaml").read_text())
    assert failure["status"] == "preempted" and failure["exit_code"] == PREEMPTED

    resumed = lightfleet("resume", str(run), "paths.output_dir=resumed")  # the line, as a requeue script runs it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "no checkpoints/last.ckpt yet: starting the run again" in resumed.stderr
    assert yaml.safe_load((tmp_path / "resumed" / "results.yaml").read_text())["global_step"] == 6
    assert logged_steps(tmp_path / "resumed")[0] == 0


@pytest.mark.parametrize("ranks", [1, 2], ids=["one_process", "two_processes"])
def test_ctrl_c_checkpoints_as_sigterm_does_and_exits_130(lightfleet, tmp_path, ranks):
    run = tmp_path / "run"
    process = start(tmp_path, f"trainer.devices={ranks}", "paths.output_dir=run")
    wait_for(run / REACHED, process)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the command's whole process group
    out, err = process.communicate(timeout=60)
    assert process.returncode == INTERRUPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "death signal" not in err, err  # torch's elastic agent's own warning: the line below says it
    step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= step < 40
    at = f" at step {step}" if ranks == 1 else ""  # the elastic agent does not know the ranks' step
    said = [line for line in err.splitlines() if line.startswith("lightfleet: ")]
    assert said == [f"lightfleet: interrupted by SIGINT{at}; checkpoint saved in {run / 'checkpoints' / 'last.ckpt'}; "
                    f"continue with: lightfleet resume {run}"], err
    failure = yaml.safe_load((run / "failure.yaml").read_text())
    assert failure["status"] == "preempted" and failure["exit_code"] == INTERRUPTED

    resumed = lightfleet("resume", str(run), "paths.output_dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "resumed" / "results.yaml").read_text())["global_step"] == 40
    assert logged_steps(tmp_path / "resumed")[0] == step  # on from the checkpoint


def test_ctrl_c_twice_in_two_processes_stops_at_once_with_130_and_no_traceback(tmp_path):
    run = tmp_path / "run"
    process = start(tmp_path, "trainer.devices=2", "paths.output_dir=run")
    wait_for(run / REACHED, process)
    ranks = rank_pids(process.pid)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.3)  # the ranks are finishing their step and voting on the checkpoint
    os.killpg(process.pid, signal.SIGINT)  # the impatient user's second Ctrl-C: stop now
    out, err = process.communicate(timeout=60)
    assert process.returncode == INTERRUPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    wait_gone(ranks, within=30)


def test_sigterm_to_the_ranks_alone_is_a_preemption_with_its_resume_line(lightfleet, tmp_path):
    """A scheduler that signals the training processes but not the command (whose torch agent then
    sees its ranks exit 143): the same checkpoint, line and record as a SIGTERM to the command."""
    run = tmp_path / "run"
    process = start(tmp_path, "trainer.devices=2", "paths.output_dir=run")
    wait_for(run / REACHED, process)
    for pid in rank_pids(process.pid):
        os.kill(pid, signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED, err
    said = [line for line in err.splitlines() if line.startswith("lightfleet: ")]
    assert said == [f"lightfleet: preempted by SIGTERM; checkpoint saved in {run / 'checkpoints' / 'last.ckpt'}; "
                    f"continue with: lightfleet resume {run}"], err
    assert yaml.safe_load((run / "failure.yaml").read_text())["status"] == "preempted"
    resumed = lightfleet("resume", str(run), "paths.output_dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_steps(tmp_path / "resumed")[0] >= 3  # on from the checkpoint


def test_sigterm_in_autos_search_ends_the_trial_with_the_command(tmp_path):
    """A signal while strategy=[auto] trials a candidate: the trial's processes end with the
    command, which says so in one line and trains nothing."""
    run = tmp_path / "run"
    # Trials leave the run's callbacks out (no SlowSteps): long ones, signalled as their ranks start.
    process = start(tmp_path, "strategy=[auto]", "trainer.devices=2", "strategy.auto.trial_steps=5000",
                    "paths.output_dir=run")
    deadline = time.monotonic() + 120
    while not (launchers := rank_pids(process.pid)) or len(rank_pids(launchers[0])) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no trial started its ranks"
        time.sleep(0.05)
    trial_processes = [launchers[0], *rank_pids(launchers[0])]
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=90)
    assert process.returncode == PREEMPTED, err
    assert err.strip().splitlines()[-1] == (f"lightfleet: stopped by SIGTERM in strategy=[auto]'s search, nothing "
                                            f"trained; its trials so far: {run / 'auto' / 'trials'}")
    wait_gone(trial_processes, within=30)
    assert not (run / "results.yaml").exists()
