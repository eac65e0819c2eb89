"""Every allowed row of conf/compat.yaml trains for real in 2 processes (gloo on CPU; pipeline with
sharding in 4: 2 pipeline replicas of 2 stages), with each member's knobs set so that it acts;
each member shows the effect it is known for, and a resume from the middle of the run ends bit for
bit where the run ended (tests/test_resume.py).

Rows come from the table itself, so a row cannot be added without being trained here. What a
strategy sets to act in a row (`ROW`) and the effect it must show (`row_effect`, over every
rank's record from tests/probe.py:Effects) come from its test module, tests/plugins/test_<name>.py."""
from __future__ import annotations

import csv

import pytest
import torch
import yaml

from probe import strategy_tests
from runner.config.compat import load_table
from test_resume import checkpoint_overrides, resumes_exactly

ROWS = sorted(sorted(row) for row in load_table().allowed)
STEPS, CHECKPOINT_STEP = 30, 13  # the resume starts in the middle of an epoch
# Sharding with pipeline is stage 1 over pipeline replicas: 2 replicas of a 2-process pipeline.
PIPELINE_SHARDING = ["trainer.devices=4", "strategy.sharding.stage=1", "strategy.sharding.pp_degree=2"]


def overrides(row: list) -> list:
    """The processes and the per-strategy settings a row trains with."""
    if {"pipeline", "sharding"} <= set(row):
        return PIPELINE_SHARDING + [o for name in row if name != "sharding" for o in strategy_tests(name).ROW]
    return ["trainer.devices=2"] + [override for name in row for override in strategy_tests(name).ROW]


@pytest.mark.parametrize("row", ROWS, ids=["+".join(row) for row in ROWS])
def test_allowed_row_trains_every_member_acts_and_resumes_bit_for_bit(row, lightfleet, tmp_path):
    extra = overrides(row)
    devices = int(next(o for o in extra if o.startswith("trainer.devices=")).partition("=")[2])
    done = lightfleet(f"strategy=[{','.join(row)}]", "paths.output_dir=run", *extra,
                      f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
                      "trainer.enable_model_summary=false", "+callbacks.effects._target_=probe.Effects",
                      *checkpoint_overrides(CHECKPOINT_STEP))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    assert sorted(yaml.safe_load((run / "plan.yaml").read_text())["strategies"]) == row
    assert len(list(run.glob("logs/*/attempt_0/*/stderr.log"))) == devices
    losses = [float(r["train_loss"]) for r in csv.DictReader((run / "csv" / "metrics.csv").open()) if r["train_loss"]]
    assert len(losses) >= 20
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.9 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    ranks = [torch.load(run / f"effects.rank{rank}.pt", weights_only=False) for rank in range(devices)]
    for name in row:
        strategy_tests(name).row_effect(ranks)
    resumes_exactly(lightfleet, tmp_path, "run", CHECKPOINT_STEP)
