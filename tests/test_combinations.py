"""Every allowed row of conf/compat.yaml trains for real in 2 processes (gloo on CPU; pipeline with
sharding in 4: 2 pipeline replicas of 2 stages), with each member's knobs set so that it acts;
each member shows the effect it is known for, and a resume from the middle of the run ends bit for
bit where the run ended (tests/helpers/resume.py).

Rows come from the table itself, so a row cannot be added without being trained here. What a
strategy sets to act in a row (`row`) and the effect it must show (`row_effect`, over every
rank's record from tests/helpers/probe.py:Effects) are declared in tests/helpers/strategies.py.

The field's models train in rows too: torchvision's ResNet-18 on a folder of PNGs and
transformers' GPT-2 (shrunk) on token files, each in rows of the table that hold every strategy
of it between them, with the same effects."""
from __future__ import annotations

import csv

import pytest
import torch
import yaml

from tests.helpers.data_files import gpt2_on_tokens, resnet_on_images
from runner.config.compat import load_table
from tests.helpers.resume import checkpoint_overrides, resumes_exactly
from tests.helpers.strategies import STRATEGIES

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

ROWS = sorted(sorted(row) for row in load_table().allowed)
STEPS, CHECKPOINT_STEP = 30, 13  # the resume starts in the middle of an epoch
# Sharding with pipeline is stage 1 over pipeline replicas: 2 replicas of a 2-process pipeline.
PIPELINE_SHARDING = ["trainer.devices=4", "strategy.sharding.stage=1", "strategy.sharding.pp_degree=2"]


def overrides(row: list) -> list:
    """The processes and the per-strategy settings a row trains with."""
    if {"pipeline", "sharding"} <= set(row):
        return PIPELINE_SHARDING + [o for name in row if name != "sharding" for o in STRATEGIES[name].row]
    return ["trainer.devices=2"] + [override for name in row for override in STRATEGIES[name].row]


def trains_and_acts(lightfleet, tmp_path, row: list, extra: list, steps: int, *more: str, fall: float = 0.1) -> None:
    """Train `row` with `extra` (trainer.devices among them) into tmp_path/run with the Effects
    probe: its plan holds the row, every process ran, the loss fell by `fall` (a fraction) and
    every member shows its effect."""
    devices = int(next(o for o in extra if o.startswith("trainer.devices=")).partition("=")[2])
    done = lightfleet(f"strategy=[{','.join(row)}]", "paths.output_dir=run", *extra,
                      f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
                      "trainer.enable_model_summary=false", "+callbacks.effects._target_=tests.helpers.probe.Effects",
                      *more)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    assert sorted(yaml.safe_load((run / "plan.yaml").read_text())["strategies"]) == row
    assert len(list(run.glob("logs/*/attempt_0/*/stderr.log"))) == devices
    losses = [float(r["train_loss"]) for r in csv.DictReader((run / "csv" / "metrics.csv").open()) if r["train_loss"]]
    assert len(losses) >= steps - 2
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < (1 - fall) * first, f"loss did not fall by {fall:.0%}: {first:.3f} -> {last:.3f}"
    ranks = [torch.load(run / f"effects.rank{rank}.pt", weights_only=False) for rank in range(devices)]
    for name in row:
        STRATEGIES[name].row_effect(ranks)


@pytest.mark.parametrize("row", ROWS, ids=["+".join(row) for row in ROWS])
def test_allowed_row_trains_every_member_acts_and_resumes_bit_for_bit(row, lightfleet, tmp_path):
    trains_and_acts(lightfleet, tmp_path, row, overrides(row), STEPS, *checkpoint_overrides(CHECKPOINT_STEP))
    resumes_exactly(lightfleet, tmp_path, "run", CHECKPOINT_STEP)


# Rows of the table that hold every strategy of it between them, for the field's models.
FIELD_ROWS = [["amp", "recompute", "sharding"], ["amp", "pipeline", "recompute"], ["adaptive_localsgd", "amp"],
              ["amp", "localsgd"], ["dgc", "recompute"], ["fp16_allreduce", "lars"], ["gradient_merge", "lamb"]]
# What each model needs besides a member's `row` (a `row`'s own model and data give way to the field's):
# LARS and DGC take a momentum SGD and LAMB an Adam; pipeline stages cannot share GPT-2's tied head
# and token embedding; a CPU computes convolutions in float16 some 20 times slower than in bfloat16.
GPT2_MOMENTUM_SGD = ["model/optimizer=sgd", "model.optimizer.weight_decay=0.1"]  # causal_lm's weight decay
FIELD_MODELS = {
    "resnet18": (resnet_on_images, {"amp": ["strategy.amp.dtype=bfloat16"],
                                    "lamb": ["model/optimizer=adamw", "model.optimizer.weight_decay=1e-4",  # vision's
                                             "model.optimizer.lr=1e-3"],
                                    "pipeline": ["strategy.pipeline.micro_batch_size=4",
                                                 "strategy.pipeline.accumulate_steps=2"]}),
    "gpt2": (gpt2_on_tokens, {"lars": [*GPT2_MOMENTUM_SGD, "model.optimizer.lr=10"],  # times lars_coeff 0.001
                              "dgc": [*GPT2_MOMENTUM_SGD, "model.optimizer.lr=0.5"],
                              "lamb": ["model.optimizer.lr=0.01"],
                              "pipeline": ["model.tie_embeddings=false"]}),
}
# In 16 steps a momentum SGD teaches GPT-2 little more than the tokens' frequencies (ln 128 -> ln
# 101, 5%): the loss must fall by 2%.
FIELD_STEPS = 16


def test_the_field_rows_are_rows_of_the_table_and_hold_every_strategy():
    assert all(row in ROWS for row in FIELD_ROWS)
    assert {name for row in FIELD_ROWS for name in row} == {name for row in ROWS for name in row}


@pytest.mark.parametrize("model", FIELD_MODELS)
@pytest.mark.parametrize("row", FIELD_ROWS, ids=["+".join(row) for row in FIELD_ROWS])
def test_the_fields_models_train_in_rows_holding_every_strategy(row, model, field_files, lightfleet, tmp_path):
    make, needs = FIELD_MODELS[model]
    settings = [o for name in row for o in STRATEGIES[name].row + needs.get(name, [])
                if not o.startswith(("model=", "data="))]
    trains_and_acts(lightfleet, tmp_path, row, make(field_files, "trainer.devices=2", *settings, "trainer.limit_val_batches=0"), FIELD_STEPS,
                    fall=0.02)
