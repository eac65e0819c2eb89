"""Preemption and orphans through the real command: SIGTERM or SIGUSR1 to the command makes every
rank finish its step, save checkpoints/last.ckpt at that step and exit 143 with one line saying
how to resume, and `lightfleet resume` finishes the run bit for bit as if it had never stopped; a
sweep stops at its preempted job and summarises; a killed command leaves no rank behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from runner.rank.parent import PREEMPTED
from test_resume import assert_same_end

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REACHED = "reached_step"  # written into the run directory once training has taken a few steps


class SlowSteps(pl.Callback):
    """Slows each step (so a signal lands mid-run) and marks when step 3 is done."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        time.sleep(0.2)
        if trainer.global_step == 3 and trainer.is_global_zero:
            Path(trainer.default_root_dir, REACHED).touch()


# Every run: 40 steps, a loss logged at each, every rank's final state saved (tests/probe.py).
RUN = ("trainer.max_steps=40", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
       "trainer.log_every_n_steps=1", "+callbacks.final._target_=probe.FinalState")


def start(tmp_path: Path, *overrides: str, multirun: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT / "tests"),
                                                                     os.environ.get("PYTHONPATH")]))}
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    command = [sys.executable, "-m", "runner", *(["-m"] if multirun else []), *RUN,
               "+callbacks.slow._target_=test_preemption.SlowSteps", *overrides]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie no one has reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list, within: float) -> None:
    """Wait until none of `pids` runs; fail if one still does `within` seconds from now."""
    since = time.monotonic()
    while any(running(pid) for pid in pids):
        assert time.monotonic() - since < within, f"ranks outlived the command by {within:.0f} s"
        time.sleep(0.2)


def rank_pids(parent: int) -> list:
    """The processes whose parent is `parent` (its ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.mark.parametrize("ranks, signum", [(1, signal.SIGTERM), (2, signal.SIGTERM), (2, signal.SIGUSR1)],
                         ids=["one_process_sigterm", "two_processes_sigterm", "two_processes_sigusr1"])
def test_a_signal_checkpoints_the_step_and_resume_finishes(lightfleet, tmp_path, ranks, signum):
    process = start(tmp_path, f"trainer.devices={ranks}", "paths.output_dir=run")
    wait_for(tmp_path / "run" / REACHED, process)
    signalled = time.monotonic()
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert process.returncode == PREEMPTED, err
    assert took < 30
    run = tmp_path / "run"
    lines = err.strip().splitlines()
    assert lines[-1].startswith("lightfleet: preempted by ") and "Traceback" not in err, err
    assert lines[-1].endswith(f"continue with: lightfleet resume {run}")
    step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= step < 40
    assert lines[-1].startswith(f"lightfleet: preempted by SIGTERM at step {step};" if ranks == 1 else
                                "lightfleet: preempted by SIGTERM;")  # SIGUSR1 reaches the ranks as SIGTERM
    assert not (run / "results.yaml").exists()
    assert yaml.safe_load((run / "failure.yaml").read_text())["status"] == "preempted"

    resumed = lightfleet("resume", "run", "paths.output_dir=resumed", "trainer.enable_progress_bar=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "resumed" / "results.yaml").read_text())["global_step"] == 40
    uninterrupted = lightfleet(*RUN, f"trainer.devices={ranks}", "paths.output_dir=full")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert_same_end(tmp_path / "full", tmp_path / "resumed", step)


def test_a_preempted_sweep_stops_at_its_job_and_summarises(tmp_path):
    process = start(tmp_path, "trainer.devices=1,2", "paths.sweep_dir=sweep", multirun=True)
    wait_for(tmp_path / "sweep" / "0" / REACHED, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED and "Traceback" not in err, err
    jobs = yaml.safe_load((tmp_path / "sweep" / "sweep.yaml").read_text())["jobs"]
    assert list(jobs) == ["0"] and jobs["0"]["status"] == "preempted"  # job 1 never started
    assert "continue with: lightfleet resume" in jobs["0"]["error"]


def test_a_killed_command_leaves_no_rank_behind(tmp_path):
    process = start(tmp_path, "trainer.devices=2", "trainer.max_steps=400", "paths.output_dir=run")
    wait_for(tmp_path / "run" / REACHED, process)
    ranks = rank_pids(process.pid)
    assert len(ranks) == 2
    process.kill()
    process.communicate(timeout=30)
    wait_gone(ranks, within=30)
