"""A rank that dies (SIGKILL by process id, as the kernel's out-of-memory killer sends it) through
the real command: one console line naming the signal in words and the resume command, exit 1,
failure.yaml saying so, never called a preemption; with trainer.max_restarts=1 the ranks start
again from the newest checkpoint and end exactly as a run never interrupted."""
from __future__ import annotations

import csv
import os
import signal
import subprocess

import pytest
import yaml

from tests.helpers.preemption import REACHED, RUN, rank_pids, start, wait_for
from tests.helpers.resume import assert_same_end

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


EVERY_2_STEPS = "+callbacks.model_checkpoint.every_n_train_steps=2"


def kill_rank_1(tmp_path, *overrides: str) -> subprocess.Popen:
    """A 2-process run of tests/helpers/preemption.py's RUN, checkpointing every 2 steps, whose rank 1
    is SIGKILLed once training has taken a few steps and written a checkpoint."""
    process = start(tmp_path, "trainer.devices=2", "paths.output_dir=run", EVERY_2_STEPS, *overrides)
    wait_for(tmp_path / "run" / REACHED, process)
    wait_for(tmp_path / "run" / "checkpoints" / "last.ckpt", process)
    ranks = sorted(rank_pids(process.pid))  # forked in rank order by the elastic agent
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    return process


def test_a_killed_rank_is_one_line_with_the_signal_in_words_and_the_resume_command(tmp_path):
    process = kill_rank_1(tmp_path)
    run = tmp_path / "run"
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, err
    assert err.strip().splitlines() == [
        f"lightfleet: run failed: rank 1: SIGKILL: killed from outside, often the out-of-memory killer (exit status "
        f"by rank {{1: -9}}; logs in {run / 'logs'}); continue with: lightfleet resume {run}"]
    failure = yaml.safe_load((run / "failure.yaml").read_text())
    assert failure["status"] == "failed" and failure["error"].startswith("SIGKILL: killed from outside")


def test_max_restarts_finishes_the_run_of_a_killed_rank_as_if_never_interrupted(lightfleet, tmp_path):
    process = kill_rank_1(tmp_path, "trainer.max_restarts=1")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    run = tmp_path / "run"
    [restart] = yaml.safe_load((run / "restarts.yaml").read_text())
    assert restart == {"restart": 1, "from_step": restart["from_step"],
                       "checkpoint": str(run / "checkpoints" / "last.ckpt")}
    assert 2 <= restart["from_step"] < 40 and restart["from_step"] % 2 == 0
    assert f"restarted 1 time(s) after a rank died, resuming from step(s) {restart['from_step']}" in out
    full = lightfleet(*RUN, "trainer.devices=2", "paths.output_dir=full", EVERY_2_STEPS)
    assert full.returncode == 0, full.stderr[-3000:]
    assert_same_end(tmp_path / "full", run, 0)  # parameters, optimizer state and every step's loss
    with (run / "csv" / "metrics.csv").open(newline="") as lines:
        logged = [int(row["step"]) for row in csv.DictReader(lines) if row["train_loss"]]
    assert logged == list(range(40))  # the steps trained again after the restart logged once
