"""Ranks forked from the command (on CPUs, runner/command/launch.py) and ranks started fresh
(LIGHTFLEET_FRESH_RANKS, and wherever CUDA is) train the same run bit for bit, each with the
threads it was given, and a forked rank survives a command whose own checks ran torch on many
threads (GNU OpenMP's worker threads do not survive a fork: a rank would wait for them forever)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.commands import command_env

pytestmark = pytest.mark.slow  # two 2-process runs

# The user's data: the built-in one, after a constructor that runs torch on every thread it has
# (the command builds the data module for its checks before it forks the ranks); and a callback
# that writes what each rank runs with.
USER_CODE = '''
import json
import os

import pytorch_lightning as pl
import torch

from runner.data import SyntheticClassificationData


class WarmData(SyntheticClassificationData):
    def __init__(self, **arguments):
        torch.randn(4_000_000).exp_().sum()  # a parallel region on every thread
        super().__init__(**arguments)


class Threads(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        seen = {"threads": torch.get_num_threads(), "command": open("/proc/self/cmdline").read().split("\\0")}
        with open(f"threads.{trainer.global_rank}.json", "w") as out:
            json.dump(seen, out)
'''
RUN = ("trainer.devices=2", "trainer.max_steps=6", "trainer.val_check_interval=6", "data._target_=user_code.WarmData",
       "+callbacks.threads._target_=user_code.Threads")


def train(folder: Path, **env: str) -> dict:
    """The run from `folder` (which holds the user's code), each rank given two threads; its results."""
    folder.mkdir()
    (folder / "user_code.py").write_text(USER_CODE)
    done = subprocess.run([sys.executable, "-m", "runner", *RUN, "paths.output_dir=run"], cwd=folder,
                          env=command_env(OMP_NUM_THREADS="2", **env), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return yaml.safe_load((folder / "run" / "results.yaml").read_text())


def ranks_ran(folder: Path) -> list:
    return [yaml.safe_load((folder / f"threads.{rank}.json").read_text()) for rank in (0, 1)]


def test_forked_and_fresh_ranks_train_alike_each_on_its_threads(tmp_path):
    forked = train(tmp_path / "forked")
    fresh = train(tmp_path / "fresh", LIGHTFLEET_FRESH_RANKS="1")

    for rank in ranks_ran(tmp_path / "forked"):  # copies of the command, not `python -m runner.train`
        assert rank["threads"] == 2 and "runner.train" not in rank["command"], rank
    for rank in ranks_ran(tmp_path / "fresh"):
        assert rank["threads"] == 2 and rank["command"][-3:-1] == ["runner.train", str(tmp_path / "fresh" / "run")]
    assert forked["global_step"] == fresh["global_step"] == 6
    assert forked["train_loss"] == fresh["train_loss"] and forked["val_loss"] == fresh["val_loss"]
