"""strategy=[auto]: the rules pick what they say for given facts, the candidates keep the user's
numerics and optimizer, memory estimates follow ZeRO's formulas, and the search measures real
trials (2 processes), survives a failing one, and leaves a best.yaml that reruns."""
from __future__ import annotations

import csv
import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml

from probe import Knob, WiringCase
from runner.config.compat import load_table
from runner.core.contribution import Facts, Memory
from runner.strategies import schemas
from runner.strategies.auto import AutoConfig, candidates, estimate, fits, rules

ROWS = load_table().allowed
NUMERICS = {name for name, schema in schemas().items() if schema.changes_numerics}
GIB = 2**30


def facts(**changes) -> Facts:
    """A momentum-SGD model with 4 blocks, 1M parameters, on one CPU process with room to spare."""
    base = Facts(parameters=1_000_000, optimizer="sgd_momentum", blocks=4, has_loss=True,
                 activation_bytes=10 * 2**20, batch_size=32, world_size=1, device="cpu",
                 device_memory_bytes=16 * GIB, bf16=True)
    return dataclasses.replace(base, **changes)


def chosen(run_facts: Facts, **knobs) -> dict:
    return rules(run_facts, AutoConfig(mode="rules", **knobs), ROWS)[0].strategies


def test_rules_for_momentum_sgd_in_one_and_two_processes():
    assert chosen(facts()) == {}  # fits, and 16-bit autocast is slow on CPUs
    assert chosen(facts(), allow_numerics_change=True) == {"lars": {}}
    choice, why = rules(facts(world_size=2), AutoConfig(allow_numerics_change=True), ROWS)
    assert choice.strategies == {"lars": {}}  # Fleet's dgc and localsgd would also apply: the table allows neither with lars
    assert why["dgc"].startswith("left out: the table does not allow it with lars")
    assert why["lamb"] == "left out: LAMB replaces Adam or AdamW; the model's optimizer is sgd_momentum"


def test_rules_for_adam_never_take_lars():
    assert chosen(facts(optimizer="adam"), allow_numerics_change=True) == {"lamb": {}}
    assert chosen(facts(optimizer="adam", device="cuda")) == {"amp": {"dtype": "bfloat16"}}
    assert chosen(facts(optimizer="adam", device="cuda", bf16=False)) == {"amp": {"dtype": "float16"}}


def test_rules_for_a_model_too_large_for_the_stated_memory():
    # Adam, float32: 16 bytes a parameter = 800 MB, plus 400 MB of activations, against 0.6 GiB.
    large = facts(parameters=50_000_000, optimizer="adam", activation_bytes=400 * 2**20, world_size=2,
                  device_memory_bytes=int(0.6 * GIB))
    choice, why = rules(large, AutoConfig(mode="rules"), ROWS)
    # Recompute halves the activations (2 of 4 blocks' worth kept), then stage 1, 2 and 3 each
    # shard one more kind; only stage 3 brings it under 0.6 GiB.
    assert choice.strategies == {"recompute": {}, "sharding": {"stage": 3}}
    assert fits(choice.memory, large) and not choice.reason
    assert "exceeds 0.60 GiB" in why["recompute"] and why["pipeline"] == "left out: the estimate fits without it"


def test_candidates_keep_the_numerics_and_the_optimizer():
    default = candidates(facts(world_size=2), AutoConfig(), ROWS)
    assert default and not any(NUMERICS & set(c.strategies) for c in default)
    allowed = candidates(facts(world_size=2), AutoConfig(allow_numerics_change=True), ROWS)
    assert any("lars" in c.strategies for c in allowed)
    assert not any("lamb" in c.strategies for c in allowed)  # an SGD model never gets LAMB


def test_candidates_over_the_memory_are_pruned_with_their_estimate():
    tight = facts(parameters=50_000_000, optimizer="adam", activation_bytes=400 * 2**20, world_size=2,
                  device_memory_bytes=int(0.6 * GIB))
    listed = {c.label: c for c in candidates(tight, AutoConfig(), ROWS)}
    assert listed["none"].status == "pruned" and listed["none"].reason.startswith("estimated 1.14 GiB per process")
    assert listed["recompute+sharding(stage=3)"].status == "candidate"
    # gradient merging only where nothing fits without it: here recompute+sharding(stage=3) does.
    assert "recompute+sharding(stage=3)+gradient_merge(k_steps=2)" not in listed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_estimate_follows_zero_formulas(stage):
    """ZeRO (Rajbhandari et al. 2020) in float32 with Adam: 4 bytes of parameters, 4 of gradients,
    8 of moments per parameter; stage k shards the last k of (moments, gradients, parameters)."""
    run, n, p = facts(optimizer="adam", world_size=4, activation_bytes=0), 4, 1_000_000
    expected = {1: 4 * p + 4 * p + 8 * p / n, 2: 4 * p + (4 + 8) * p / n, 3: (4 + 4 + 8) * p / n}[stage]
    memory, _ = estimate(run, {"sharding": schemas()["sharding"](stage=stage)})
    assert memory.total == pytest.approx(expected)
    assert Memory.of(run).total == 16 * p


def read(path: Path):
    return yaml.safe_load(path.read_text())


def candidate_rows(run: Path) -> list:
    with open(run / "auto" / "candidates.csv") as table:
        return list(csv.DictReader(table))


def test_search_in_two_processes_chooses_measured_and_best_yaml_reruns(lightfleet, tmp_path):
    done = lightfleet("strategy=[auto]", "model=gpt", "data=language_model", "trainer.devices=2",
                      "strategy.auto.max_trials=2", "strategy.auto.trial_steps=4", "trainer.max_steps=4",
                      "trainer.enable_progress_bar=false", "paths.output_dir=run", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = candidate_rows(tmp_path / "run")
    measured = [row for row in rows if row["status"] == "ok"]
    assert len(measured) == 2 and all(float(row["samples_per_s"]) > 0 for row in measured)
    assert {row["status"] for row in rows} <= {"ok", "not tried", "refused", "pruned"}
    choice = read(tmp_path / "run" / "auto" / "choice.yaml")
    fastest = max(measured, key=lambda row: float(row["samples_per_s"]))
    assert choice["chosen"] == fastest["strategies"]
    # Decided once, before the ranks started: the run trains the choice on both ranks.
    assert read(tmp_path / "run" / "plan.yaml")["strategies"] == list(choice["strategies"])
    assert read(tmp_path / "run" / "results.yaml")["world_size"] == 2
    assert "auto: lamb: left out:" in done.stdout and "experiment=best" in done.stdout
    report = lightfleet("report", "run/auto")  # the trials compared like a sweep's jobs
    assert report.returncode == 0
    with open(tmp_path / "run" / "auto" / "report.csv") as table:
        assert [row["status"] for row in csv.DictReader(table)].count("ok") == 2
    again = lightfleet("--config-dir", str(tmp_path / "run" / "auto"), "experiment=best", "trainer.max_steps=2",
                       "trainer.enable_progress_bar=false", "paths.output_dir=again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read(tmp_path / "again" / "plan.yaml")["strategies"] == list(choice["strategies"])
    assert read(tmp_path / "again" / "config.yaml")["model"] == read(tmp_path / "run" / "config.yaml")["model"]


USER_MODEL = '''
    import pytorch_lightning as pl
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())

        def forward(self, x):
            return x + self.inner(x)


    class NoAutocastNet(pl.LightningModule):
        """Nested blocks with batch norm, that runs out of memory under autocast (as a model too
        large for 16-bit copies might)."""

        def __init__(self, width=32):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(3))
            self.head = nn.Linear(width, 4)

        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                raise torch.OutOfMemoryError("out of memory (the test's model under autocast)")
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = nn.functional.cross_entropy(self(inputs), targets)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
'''


def test_a_failing_candidate_does_not_end_the_search(lightfleet, tmp_path):
    (tmp_path / "user_model.py").write_text(textwrap.dedent(USER_MODEL))
    done = lightfleet("strategy=[auto]", "~model", "+model._target_=user_model.NoAutocastNet",
                      "strategy.auto.trial_steps=3", "trainer.max_steps=3", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = {row["strategies"]: row["status"] for row in candidate_rows(tmp_path / "run")}
    assert statuses == {"none": "ok", "recompute": "ok", "amp(dtype=bfloat16)": "out_of_memory",
                        "amp(dtype=bfloat16)+recompute": "out_of_memory"}
    assert read(tmp_path / "run" / "auto" / "choice.yaml")["chosen"] in ("none", "recompute")
    assert read(tmp_path / "run" / "results.yaml")["global_step"] == 3


def trials(run: Path) -> list:
    return sorted((run / "auto" / "trials").iterdir()) if (run / "auto" / "trials").exists() else []


# Every knob read off what auto did, from the run directory (tests/test_wiring.py).
WIRING = [
    WiringCase({"mode": Knob("rules", lambda run: "search" if trials(run) else "rules"),
                "allow_numerics_change": Knob(True, lambda run: any(row["strategies"].startswith("lars")
                                                                    for row in candidate_rows(run))),
                "device_memory_gb": Knob(0.5, lambda run: read(run / "auto" / "choice.yaml")["facts"]
                                         ["device_memory_bytes"] / GIB)}, from_run_dir=True),
    WiringCase({"trial_steps": Knob(3, lambda run: read(trials(run)[0] / "config.yaml")["trainer"]["max_steps"]),
                "max_trials": Knob(2, lambda run: len(trials(run))),
                "search_only": Knob(True, lambda run: not (run / "results.yaml").exists()
                                    and (run / "auto" / "experiment" / "best.yaml").is_file())}, from_run_dir=True),
    # A budget spent at once: the first trial starts, no other.
    WiringCase({"budget_s": Knob(0.001, lambda run: len(trials(run)), expected=1)}, from_run_dir=True),
]


def test_the_facts_count_the_activations_one_batch_saves():
    from plugins.auto import gather_facts
    from runner.data import SyntheticClassificationData
    from runner.models import MLPClassifier

    def activations(batch: int) -> int:
        return gather_facts(MLPClassifier, SyntheticClassificationData(batch_size=batch), device="cpu", world_size=1,
                            num_nodes=1, batch_size=batch, device_memory_gb=None).activation_bytes

    # At least the float32 input of every Linear (the stem's 32 features, 2 x 64 in each of 3 blocks),
    # and in proportion to the batch.
    assert activations(32) >= 32 * 4 * (32 + 3 * 2 * 64)
    assert activations(64) == pytest.approx(2 * activations(32), rel=1e-3)  # the loss: a few scalars
