"""The real command as a process a test signals (tests/test_preemption.py, tests/test_interrupts.py):
`start` runs it slowed down by `SlowSteps`, which marks the run directory with REACHED once training
has taken a few steps; `wait_for` a file, `rank_pids` of a process (`process_tree`: all below it),
`wait_gone` of processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from tests.helpers.commands import command_env

REACHED = "reached_step"  # written into the run directory once training has taken a few steps
CHECKPOINTING = "checkpointing"  # written into the run directory as the first checkpoint is saved


class SlowSteps(pl.Callback):
    """Slows each step (so a signal lands mid-run) and marks when step 3 is done."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        time.sleep(0.2)
        if trainer.global_step == 3 and trainer.is_global_zero:
            Path(trainer.default_root_dir, REACHED).touch()


class HeavyCheckpoints(pl.Callback):
    """Makes every checkpoint `megabytes` heavier (a tensor beside the model's), so that the disk
    takes a while to write it (runner/rank/checkpoint_io.py writes in the background) and a signal
    lands while it is pending; marks the run directory as the first one is saved."""

    def __init__(self, megabytes: int) -> None:
        self.megabytes = megabytes

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["heavy"] = torch.ones(self.megabytes << 18)  # float32
        if trainer.is_global_zero:
            Path(trainer.default_root_dir, CHECKPOINTING).touch()


# Every run: 40 steps, a loss logged at each, every rank's final state saved (tests/helpers/probe.py).
RUN = ("trainer.max_steps=40", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
       "trainer.log_every_n_steps=1", "+callbacks.final._target_=tests.helpers.probe.FinalState")


def start(tmp_path: Path, *overrides: str, multirun: bool = False) -> subprocess.Popen:
    """The command with RUN, SlowSteps and `overrides`, from `tmp_path`, in a session of its own."""
    command = [sys.executable, "-m", "runner", *(["-m"] if multirun else []), *RUN,
               "+callbacks.slow._target_=tests.helpers.preemption.SlowSteps", *overrides]
    return subprocess.Popen(command, cwd=tmp_path, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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


def stop(pid: int, within: float = 10) -> None:
    """SIGSTOP `pid` and wait until each of its threads is stopped (kill() returns before they
    are: a thread on another core runs on for a moment)."""
    os.kill(pid, signal.SIGSTOP)
    since = time.monotonic()
    while any(Path(task, "stat").read_text().rsplit(")", 1)[1].split()[0] not in "Tt"
              for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() - since < within, f"process {pid} did not stop"
        time.sleep(0.0005)


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


def process_tree(root: int) -> list:
    """Every process below `root` (children, theirs, ...), as /proc shows them now."""
    found, parents = [], [root]
    while parents:
        children = [child for parent in parents for child in rank_pids(parent)]
        found += children
        parents = children
    return found
