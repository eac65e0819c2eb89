"""A rank that dies (SIGKILL by process id, as the kernel's out-of-memory killer sends it) through
the real command: one console line naming the signal in words and the resume command, exit 1,
failure.yaml saying so; never called a preemption."""
from __future__ import annotations

import os
import signal

import pytest
import yaml

from tests.helpers.preemption import REACHED, rank_pids, start, wait_for

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


def test_a_killed_rank_is_one_line_with_the_signal_in_words_and_the_resume_command(tmp_path):
    process = start(tmp_path, "trainer.devices=2", "paths.output_dir=run",
                    "+callbacks.model_checkpoint.every_n_train_steps=2")
    wait_for(tmp_path / "run" / REACHED, process)
    run = tmp_path / "run"
    wait_for(run / "checkpoints" / "last.ckpt", process)
    ranks = sorted(rank_pids(process.pid))  # forked in rank order by the elastic agent
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, err
    assert err.strip().splitlines() == [
        f"lightfleet: run failed: rank 1: SIGKILL: killed from outside, often the out-of-memory killer (exit status "
        f"by rank {{1: -9}}; logs in {run / 'logs'}); continue with: lightfleet resume {run}"]
    failure = yaml.safe_load((run / "failure.yaml").read_text())
    assert failure["status"] == "failed" and failure["error"].startswith("SIGKILL: killed from outside")
