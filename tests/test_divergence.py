"""Non-finite training through the real command (runner/rank/divergence.py): a loss or a parameter
that becomes NaN or Inf stops the run with one line naming the step and the last checkpoint written
before it, exit status 3 and failure.yaml's status `diverged`; no checkpoint with non-finite weights
replaces a good one; amp's skipped overflow steps do not trip it; stop_on_nonfinite=false trains on."""
from __future__ import annotations

import math
import re

import pytest
import torch
import yaml

from runner.rank.parent import DIVERGED_EXIT
from runner.records import checkpoints
from runner.records.jobs import collect_jobs

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

QUIET = ("trainer.enable_progress_bar=false", "trainer.limit_val_batches=0")
STEP = r"diverged: the loss became non-finite \(NaN or Inf\) at step (\d+); "


def test_a_learning_rate_that_diverges_stops_the_run_naming_the_step(lightfleet, tmp_path):
    done = lightfleet("model.optimizer.lr=1e6", "trainer.max_steps=30", "paths.output_dir=run", *QUIET)
    assert done.returncode == DIVERGED_EXIT, done.stderr[-3000:]
    run = tmp_path / "run"
    [line] = done.stderr.strip().splitlines()
    said = re.fullmatch(f"lightfleet: {STEP}no checkpoint was written before it", line)
    assert said and 1 <= int(said[1]) < 30, line
    failure = yaml.safe_load((run / "failure.yaml").read_text())
    assert failure == {"status": "diverged", "exit_code": DIVERGED_EXIT, "error": line.removeprefix("lightfleet: ")}
    assert not (run / "results.yaml").exists()  # the record of a finished run
    assert not list(run.glob("checkpoints/*"))  # every checkpoint would have held non-finite weights
    assert collect_jobs([run])[0].status == line.removeprefix("lightfleet: ")  # lightfleet report's words

    # The knob turns the guard off: the same run trains on to its end, as it did before the guard.
    off = lightfleet("model.optimizer.lr=1e6", "trainer.max_steps=30", "paths.output_dir=off",
                     "stop_on_nonfinite=false", *QUIET)
    assert off.returncode == 0, off.stderr[-3000:]
    assert math.isnan(yaml.safe_load((tmp_path / "off" / "results.yaml").read_text())["train_loss"])


@pytest.mark.parametrize("ranks, nan_step", [(1, 5), (2, 5), (2, 8)], ids=["one_process", "two_processes",
                                                                         "two_processes_last_step"])
def test_a_loss_gone_nan_after_a_checkpoint_keeps_the_good_last_checkpoint(lightfleet, tmp_path, ranks, nan_step):
    # Checkpoints every 2 steps of 8; step `nan_step`'s inputs are NaN, so its loss and the weights it
    # leaves are: no later checkpoint (the next one, or fit's last one) may replace the one before.
    # In two processes the vote reads step 5's flag at step 6, before the checkpoint callback saves;
    # elsewhere the check before each save (one process) or at fit's end (the last step) finds it.
    done = lightfleet(f"trainer.devices={ranks}", "trainer.max_steps=8", "paths.output_dir=run", *QUIET,
                      "+callbacks.model_checkpoint.every_n_train_steps=2",
                      "+callbacks.nan._target_=tests.helpers.probe.NaNInputs", f"+callbacks.nan.step={nan_step}")
    assert done.returncode == DIVERGED_EXIT, done.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert done.stderr.strip().splitlines() == [
        f"lightfleet: diverged: the loss became non-finite (NaN or Inf) at step {nan_step}; the last checkpoint "
        f"written before it: {last}"]
    good = nan_step - 1 - (nan_step - 1) % 2
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == good
    assert all(torch.isfinite(tensor).all() for tensor in checkpoint["state_dict"].values())
    assert sorted(path.name for path in last.parent.iterdir()) == [
        f"epoch=0-step={good}.ckpt", f"epoch=0-step={good}.ckpt.manifest.json", "last.ckpt", "last.ckpt.manifest.json"]
    assert checkpoints.verify(last).problem is None
    assert yaml.safe_load((tmp_path / "run" / "failure.yaml").read_text())["status"] == "diverged"


def test_amps_skipped_overflow_steps_do_not_trip_the_guard(lightfleet, tmp_path):
    # tests/test_gpu.py's overflow, on the CPU: a loss scale of 2^40 overflows float16 gradients, and
    # the scaler skips those steps and halves the scale every 2 of them.
    done = lightfleet("strategy=[amp]", "strategy.amp.init_loss_scaling=1099511627776", "trainer.max_steps=20",
                      "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["MixedPrecision"]["scale"] < 2.0 ** 40  # steps were skipped
    assert checkpoint["global_step"] == 20
