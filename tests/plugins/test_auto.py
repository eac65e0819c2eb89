"""strategy=[auto]: the rules pick what they say for given facts, always a candidate that fits, at
the largest micro-batch that fits, and refuse in one line when none does; the candidates keep the
user's numerics and optimizer, memory estimates follow ZeRO's formulas, and the search measures
real trials (2 processes), survives a failing one, and leaves a best.yaml that reruns, even copied alone."""
from __future__ import annotations

import csv
import dataclasses
import re
import shutil
import textwrap
import time

import pytest

from runner.config.compat import load_table
from runner.core.contribution import Facts, Memory
from runner.strategies import schemas
from runner.core.errors import ConfigError
from runner.records.files import AGAIN
from runner.strategies._auto_search import RunCost, search_plan
from runner.strategies.auto import (AutoConfig, Candidate, accounts, candidates, contenders, estimate, fits,
                                    memory_text, rules, verdict)
from tests.helpers.strategies import candidate_rows, read

ROWS = load_table().allowed
NUMERICS = {name for name, schema in schemas().items() if schema.changes_numerics}
GIB = 2**30


def facts(**changes) -> Facts:
    """A momentum-SGD model with 4 blocks, 1M parameters, on one CPU process with room to spare."""
    base = Facts(parameters=1_000_000, optimizer="sgd_momentum", blocks=4, has_loss=True,
                 activation_bytes=10 * 2**20, batch_size=32, world_size=1, device="cpu",
                 device_memory_bytes=16 * GIB, bf16=True)
    return dataclasses.replace(base, **changes)


def rules_for(run_facts: Facts, **knobs):
    auto = AutoConfig(mode="rules", **knobs)
    return rules(run_facts, auto, candidates(run_facts, auto, ROWS), ROWS)


def chosen(run_facts: Facts, **knobs) -> dict:
    return rules_for(run_facts, **knobs).winner.strategies


def test_rules_for_momentum_sgd_in_one_and_two_processes():
    assert chosen(facts()) == {}  # fits, and 16-bit autocast is slow on CPUs
    assert chosen(facts(), allow_numerics_change=True) == {"lars": {}}
    choice = rules_for(facts(world_size=2), allow_numerics_change=True)
    assert choice.winner.strategies == {"lars": {}}  # Fleet's dgc and localsgd would also apply: the table allows neither with lars
    assert choice.why["dgc"].startswith("left out: the table does not allow it with lars")
    assert choice.why["lamb"] == "left out: LAMB replaces Adam or AdamW; the model's optimizer is sgd_momentum"


def test_rules_for_adam_never_take_lars():
    assert chosen(facts(optimizer="adam"), allow_numerics_change=True) == {"lamb": {}}
    assert chosen(facts(optimizer="adam", device="cuda")) == {"amp": {"dtype": "bfloat16"}}
    assert chosen(facts(optimizer="adam", device="cuda", bf16=False)) == {"amp": {"dtype": "float16"}}


# Adam, float32: 16 bytes a parameter = 800 MB, plus 400 MB of activations, in 2 processes.
LARGE = dict(parameters=50_000_000, optimizer="adam", activation_bytes=400 * 2**20, world_size=2)


@pytest.mark.parametrize("memory_gib", [0.3, 0.45, 0.6, 0.9, 1.5])
def test_rules_choose_the_first_by_speed_of_the_candidates_that_fit(memory_gib):
    """Whatever the memory, the rules' choice fits while any candidate does (no ladder stopping
    at a strategy the table refuses), and no faster candidate fits (CPU: amp only if nothing else fits)."""
    large = facts(**LARGE, device_memory_bytes=int(memory_gib * GIB))
    listed = candidates(large, AutoConfig(mode="rules"), ROWS)
    choice = rules(large, AutoConfig(mode="rules"), listed, ROWS)
    fitting = [c for c in listed if c.status == "candidate"]
    assert fitting and fits(choice.winner.memory, large) and choice.winner.status == "candidate"
    without_amp = [c for c in fitting if "amp" not in c.strategies] or fitting
    assert choice.winner.speed == max(c.speed for c in without_amp)
    for name, why in choice.why.items():
        assert why.startswith("taken: " if name in choice.winner.strategies else "left out: "), (name, why)
    for name in choice.winner.strategies:  # taken: without it the estimate is over, or (no preference here) it ranks first
        assert "per process >" in choice.why[name] or "ranks first" in choice.why[name], choice.why[name]
    winner_line = verdict("rules", choice, listed, large)[0]
    assert winner_line.startswith(f"auto (rules): chose {choice.winner.label}: estimated ")
    assert "rank 1 of" in winner_line and "0.00 GiB" not in winner_line


def test_nothing_fits_is_refused_in_one_line_with_the_smallest_estimate_and_the_ways_out():
    tiny = facts(**LARGE, device_memory_bytes=2**20)  # 1 MiB for 800 MB of weights and states
    listed = candidates(tiny, AutoConfig(mode="rules", device_memory_gb=1 / 1024), ROWS)
    assert all(c.status == "pruned" for c in listed)
    smallest = min(listed, key=lambda c: c.memory.total)
    with pytest.raises(ConfigError) as refused:
        contenders(listed, tiny, AutoConfig(device_memory_gb=1 / 1024))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("strategy.auto.device_memory_gb=0.0009765625: no candidate fits: "
                                                       f"the smallest estimate, {smallest.label}, is ")
    assert f"{memory_text(smallest.memory.total)} per process > 1.0 MiB" in message
    assert "more processes (now 2)" in message and "strategy.auto.device_memory_gb >= " in message
    # Only the weights and states alone fit: a smaller batch helps, and the command says how small.
    small = facts(blocks=0, activation_bytes=2000 * 2**20, device_memory_bytes=100 * 2**20)
    with pytest.raises(ConfigError, match=r"data\.batch_size <= \d+ \(now 32\)"):
        rules_for(small, device_memory_gb=100 / 1024)


def test_the_largest_micro_batch_that_fits_is_kept_and_chosen():
    """Gradient merging splits the batch of 32 into k micro-batches, the global batch unchanged:
    12 MB of weights, gradients and momentum plus 40 MiB of activations fit 35 MiB only with
    k = 2 or more, and the rules take k = 2 (micro-batches of 16), as DeepSpeed's autotuner takes
    the largest micro-batch that fits."""
    split = facts(activation_bytes=40 * 2**20, device_memory_bytes=35 * 2**20)
    listed = {c.label: c for c in candidates(split, AutoConfig(mode="rules"), ROWS)}
    assert listed["none"].status == "pruned" and listed["gradient_merge(k_steps=2)"].status == "candidate"
    assert "gradient_merge(k_steps=4)" not in listed  # a smaller micro-batch where 16 fits: never better
    choice = rules_for(split)
    assert choice.winner.strategies == {"gradient_merge": {"k_steps": 2}} and choice.winner.micro_batch == 16
    assert choice.why["gradient_merge"].startswith("taken: without it, estimated ")
    assert listed["none"].reason == f"estimated {memory_text(listed['none'].memory.total)} per process > 35.0 MiB"


def test_a_gradient_merge_choice_trains_micro_batches_of_the_same_global_batch(spec_for):
    from runner.command.autotune import with_strategies

    spec = spec_for("strategy=[auto]", "model=gpt", "data=language_model")
    chosen_spec = with_strategies(spec, {"gradient_merge": {"k_steps": 4}})
    assert chosen_spec.batch_size * 4 == spec.batch_size == 32
    assert chosen_spec.strategies["gradient_merge"].k_steps == 4 and "auto" not in chosen_spec.strategies
    assert with_strategies(spec, {"recompute": {}}).batch_size == 32


def test_memory_figures_read_in_the_unit_they_reach():
    assert memory_text(13.7 * 2**20) == "13.7 MiB"
    assert memory_text(5.1 * 2**20) == "5.1 MiB"
    assert memory_text(1.14 * GIB) == "1.14 GiB"
    assert memory_text(96 * 2**10) == "96.0 KiB"
    assert memory_text(0.005 * GIB) == "5.1 MiB"  # strategy.auto.device_memory_gb=0.005: not "0.00 GiB"


def test_candidates_keep_the_numerics_and_the_optimizer():
    default = candidates(facts(world_size=2), AutoConfig(), ROWS)
    assert default and not any(NUMERICS & set(c.strategies) for c in default)
    allowed = candidates(facts(world_size=2), AutoConfig(allow_numerics_change=True), ROWS)
    assert any("lars" in c.strategies for c in allowed)
    assert not any("lamb" in c.strategies for c in allowed)  # an SGD model never gets LAMB


def test_candidates_over_the_memory_are_pruned_with_their_estimate():
    tight = facts(parameters=50_000_000, optimizer="adam", activation_bytes=400 * 2**20, world_size=2,
                  device_memory_bytes=int(0.65 * GIB))
    listed = {c.label: c for c in candidates(tight, AutoConfig(), ROWS)}
    assert listed["none"].status == "pruned" and listed["none"].reason.startswith("estimated 1.14 GiB per process")
    assert listed["recompute+sharding(stage=3)"].status == "candidate"
    # gradient merging only where nothing fits without it: here recompute+sharding(stage=3) does.
    assert "recompute+sharding(stage=3)+gradient_merge(k_steps=2)" not in listed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_estimate_follows_zero_formulas(stage):
    """ZeRO (Rajbhandari et al. 2020) in float32 with Adam: 4 bytes of parameters, 4 of gradients,
    8 of moments per parameter; stage k shards the last k of (moments, gradients, parameters).
    FSDP2 (stages 2 and 3) holds besides the gathered parameters (stage 2 all of them from forward
    to the end of backward, stage 3 one unit of segment_broadcast_MB) and one unit's gradients
    before they are reduced to its shard."""
    run, n, p = facts(optimizer="adam", world_size=4, activation_bytes=0), 4, 1_000_000
    unit = 2**20  # segment_broadcast_MB=1: a quarter of the 4 MB of parameters
    expected = {1: 4 * p + 4 * p + 8 * p / n,
                2: (4 * p / n + 4 * p) + ((4 * p - unit) / n + unit) + 8 * p / n,
                3: (4 * p / n + unit) + ((4 * p - unit) / n + unit) + 8 * p / n}[stage]
    memory, _ = estimate(run, {"sharding": schemas()["sharding"](stage=stage, segment_broadcast_MB=1.0)})
    assert memory.total == pytest.approx(expected)
    assert Memory.of(run).total == 16 * p


def test_the_search_is_scaled_to_the_job_unless_the_user_bounds_it():
    """Before any trial a trial is taken as twice the command's start-up; a short job gets the
    fewest trials (2) of at most its own steps, a long one trials for a quarter of its expected
    time, none starting after 600 s; the user's trial_steps, max_trials and budget_s win."""
    before = RunCost.before_trials(15.0)
    assert before.seconds(20) == 30.0 and before.step_s is None
    toy = search_plan(AutoConfig(), 40, 20, before)
    assert (toy.steps, toy.most, toy.expected, toy.seconds) == (20, 2, 2, 60.0)
    assert search_plan(AutoConfig(), 8, 20, before).steps == 8
    measured = RunCost.measured([(35.0, 20, 0.25), (29.0, 20, 0.2)])
    assert (measured.startup_s, measured.step_s) == (27.5, 0.2)  # the median start-up, the fastest step
    assert (measured.seconds(20), measured.job_seconds(2000)) == (31.5, 413.75)  # the job's ranks start once
    long_job = search_plan(AutoConfig(), 2000, 20, measured)  # a quarter of 413.75 s: 3 trials of 31.5 s
    assert (long_job.steps, long_job.most, long_job.expected) == (20, 3, 3)
    longer = search_plan(AutoConfig(), 200_000, 40, measured)
    assert longer.expected == 600 // 31.5 + 1 and longer.budget_s == 600  # trials start until 600 s
    assert search_plan(AutoConfig(), 40, 1, before).expected == 1  # no more than fit
    by_epochs = search_plan(AutoConfig(), None, 20, before)
    assert (by_epochs.steps, by_epochs.most, by_epochs.expected) == (20, None, 20)
    mine = search_plan(AutoConfig(trial_steps=50, max_trials=5), 40, 20, before)
    assert (mine.steps, mine.most, mine.expected) == (50, 5, 5)
    timed = search_plan(AutoConfig(budget_s=100.0), 40, 20, before)
    assert (timed.most, timed.expected, timed.budget_s) == (None, 4, 100.0)


def test_a_left_out_strategy_quotes_its_own_candidates_figures_then_the_best_with_it():
    """amp's reason quotes amp's own trial (the figure its trial line printed), and the best
    candidate with it, when another (amp+recompute measured faster than amp alone)."""
    from runner.command.autotune import faster

    measured = {"none": 100.0, "amp": 50.0, "amp+recompute": 60.0, "recompute": 90.0, "sharding": 40.0}
    listed = [Candidate({name: {} for name in label.split("+")} if label != "none" else {}, Memory(0, 0, 0, 0), 1.0,
                        status="ok", measured={"samples_per_s": rate}) for label, rate in measured.items()]
    ranked = sorted(listed, key=lambda c: -c.measured["samples_per_s"])
    run = facts(world_size=2)
    why = accounts(ranked, listed, run, AutoConfig(), faster, preferred={}, left_out={})
    assert why["amp"] == ("left out: none fits and ranks before amp by measured samples/s (100.0 vs 50.0) and before "
                          "the best with it, amp+recompute, by measured samples/s (100.0 vs 60.0)")
    assert why["sharding"] == "left out: none fits and ranks before sharding by measured samples/s (100.0 vs 40.0)"


@pytest.mark.slow
def test_search_in_two_processes_chooses_measured_and_best_yaml_reruns(lightfleet, tmp_path):
    """Also: by default a search is scaled to its job (4 steps: 2 trials of 4 steps), said with its
    estimate before it starts; the done line says the training's time apart from the search's;
    the libraries' warnings in the command's own work (torchdata's on the first batch) stay in the log."""
    started = time.monotonic()
    done = lightfleet("strategy=[auto]", "model=gpt", "data=language_model", "trainer.devices=2", "trainer.max_steps=4",
                      "trainer.enable_progress_bar=false", "paths.output_dir=run", timeout=600)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^auto: \d+ candidates fit; 2 trials planned, 4 steps each, about \d+ s in all \(an estimate: "
                     r"\d+ s a trial, its launcher's and then its ranks' start-up, each taken as long as this "
                     r"command's", done.stdout, re.M)
    assert all(read(trial / "config.yaml")["trainer"]["max_steps"] == 4
               for trial in (tmp_path / "run" / "auto" / "trials").iterdir())
    assert "set_vital" not in done.stderr and "set_vital" in (tmp_path / "run" / "lightfleet.log").read_text()
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
    confirmed = "both ran again" in choice["reason"]  # the top two within noise: each tried twice
    with open(tmp_path / "run" / "auto" / "report.csv") as table:
        assert [row["status"] for row in csv.DictReader(table)].count("ok") == (4 if confirmed else 2)
    # The trials' own times: each measured from its own start (results.yaml), as the search saw it.
    for row in measured:
        trial = read(tmp_path / "run" / "auto" / "trials" / row["candidate"] / "results.yaml")
        assert 0 < trial["startup_s"] < trial["wall_s"] <= float(row["trial_s"])
    said = re.search(r"^lightfleet: done: 4 steps in ([\d.]+) s, .*; auto's search ([\d.]+) s, (\d) trials; run "
                     r"directory ", done.stdout, re.M)
    assert said and int(said[3]) == (4 if confirmed else 2), done.stdout[-2000:]
    training = read(tmp_path / "run" / "results.yaml")
    assert float(said[1]) == pytest.approx(training["wall_s"], abs=0.1)  # the training's own, the search apart
    assert training["wall_s"] + float(said[2]) <= elapsed
    again = lightfleet("--config-dir", str(tmp_path / "run" / "auto"), "experiment=best", "trainer.max_steps=2",
                       "trainer.enable_progress_bar=false", "paths.output_dir=again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read(tmp_path / "again" / "plan.yaml")["strategies"] == list(choice["strategies"])
    assert read(tmp_path / "again" / "config.yaml")["model"] == read(tmp_path / "run" / "config.yaml")["model"]


# conf/model/gpt.yaml's decoder in 2 processes, planned for 5 MiB a process: only some candidates fit.
TIGHT_GPT = ("strategy=[auto]", "model=gpt", "data=language_model", "trainer.devices=2", "strategy.auto.mode=rules",
             "strategy.auto.device_memory_gb=0.005")


@pytest.mark.slow
def test_rules_in_two_processes_train_a_candidate_that_fits_and_best_yaml_reruns_copied_alone(lightfleet, tmp_path):
    done = lightfleet(*TIGHT_GPT, "trainer.max_steps=2", "trainer.enable_progress_bar=false", "paths.output_dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    choice = read(tmp_path / "run" / "auto" / "choice.yaml")
    rows = {row["strategies"]: row for row in candidate_rows(tmp_path / "run")}
    limit_mib = choice["facts"]["device_memory_bytes"] / 2**20
    winner = rows[choice["chosen"]]
    assert winner["status"] == "candidate" and float(winner["estimated_memory_mib"]) <= limit_mib
    assert rows["none"]["status"] == "pruned"  # the choice was needed
    fitting = [row for row in rows.values() if row["status"] == "candidate"]
    assert float(winner["estimated_speed"]) == max(float(row["estimated_speed"]) for row in fitting
                                                   if "amp" not in row["strategies"])
    assert f"auto (rules): chose {choice['chosen']}: estimated " in done.stdout and "auto: runner-up " in done.stdout
    assert "0.00 GiB" not in done.stdout and "MiB per process" in done.stdout
    assert re.search(r"^lightfleet: done: 2 steps in [\d.]+ s, .*; auto's rules [\d.]+ s; run directory ", done.stdout,
                     re.M), done.stdout[-2000:]
    # The global batch stays 32: gradient merging's k micro-batches of 32 / k.
    config = read(tmp_path / "run" / "config.yaml")
    k_steps = choice["strategies"].get("gradient_merge", {}).get("k_steps", 1)
    assert config["data"]["batch_size"] * k_steps == 32 == choice["facts"]["batch_size"]
    assert int(winner["micro_batch"]) == config["data"]["batch_size"] == choice["micro_batch"]
    # experiment/best.yaml alone in another config directory reruns the winner.
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    shutil.copy(tmp_path / "run" / "auto" / "experiment" / "best.yaml", tmp_path / "mine" / "experiment")
    again = lightfleet("--config-dir", "mine", "experiment=best", "trainer.max_steps=1", "paths.output_dir=again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read(tmp_path / "again" / "plan.yaml")["strategies"] == list(choice["strategies"])
    rerun = read(tmp_path / "again" / "config.yaml")
    for group in ("model", "data", "strategy"):
        assert rerun[group] == config[group], group


@pytest.mark.slow
def test_a_model_that_fits_nowhere_is_refused_in_one_line_and_nothing_trains(lightfleet, tmp_path):
    done = lightfleet(*TIGHT_GPT, "strategy.auto.device_memory_gb=0.0001", "paths.output_dir=run")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("lightfleet:")]
    assert len(said) == 1 and said[0].startswith("lightfleet: error: strategy.auto.device_memory_gb=0.0001: no "
                                                 "candidate fits: the smallest estimate, "), done.stderr
    assert "MiB per process > 104.9 KiB" in said[0] and "more processes (now 2)" in said[0]
    assert not (tmp_path / "run" / "results.yaml").exists() and not (tmp_path / "run" / "auto").exists()


@pytest.mark.slow
def test_dry_run_shows_the_facts_candidates_and_the_rules_choice_and_trains_nothing(lightfleet, tmp_path):
    done = lightfleet("dry_run=true", *TIGHT_GPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "strategies: auto" in done.stdout  # the plan, as any dry run prints it
    assert "auto: facts: parameters=" in done.stdout and "device_memory_bytes=5.1 MiB" in done.stdout
    assert "auto: candidates (" in done.stdout and "  none: " in done.stdout
    assert "auto (rules): chose " in done.stdout and "auto: gradient_merge: " in done.stdout
    searched = lightfleet("dry_run=true", *TIGHT_GPT, "strategy.auto.mode=search")
    assert searched.returncode == 0 and "auto (search): would run trials of up to " in searched.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing trained


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


@pytest.mark.slow
def test_a_failing_candidate_does_not_end_the_search(lightfleet, tmp_path):
    (tmp_path / "user_model.py").write_text(textwrap.dedent(USER_MODEL))
    done = lightfleet("strategy=[auto]", "~model", "+model._target_=user_model.NoAutocastNet",
                      "strategy.auto.max_trials=4", "strategy.auto.trial_steps=3", "trainer.max_steps=3", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = {row["strategies"]: row["status"] for row in candidate_rows(tmp_path / "run")}
    assert statuses == {"none": "ok", "recompute": "ok", "amp(dtype=bfloat16)": "out_of_memory",
                        "amp(dtype=bfloat16)+recompute": "out_of_memory"}
    assert read(tmp_path / "run" / "auto" / "choice.yaml")["chosen"] in ("none", "recompute")
    assert read(tmp_path / "run" / "results.yaml")["global_step"] == 3


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


@pytest.mark.parametrize("again, lead", [((90.0, 99.0), "recompute"), ((101.0, 95.0), "none")],
                         ids=["the_lead_changes", "the_lead_holds"])
def test_the_top_two_trials_within_noise_run_again_and_rank_by_their_mean(again, lead, monkeypatch, tmp_path):
    """100 and 97 samples/s are within 5%: both run again (here a stand-in for the trial's processes
    sets what a second trial measured) and the mean of two ranks them."""
    from runner.command import autotune
    from runner.strategies.auto import Candidate

    listed = [Candidate({}, Memory(0, 0, 0, 0), 1.0), Candidate({"recompute": {}}, Memory(0, 0, 0, 0), 0.75)]
    for c, first in zip(listed, (100.0, 97.0)):
        c.status, c.measured = "ok", {"samples_per_s": first}
    seconds = iter(again)

    def second_trial(spec, c, auto, trial_dir, command):
        c.measured = {"samples_per_s": next(seconds)}
        assert trial_dir.name.endswith(AGAIN)

    monkeypatch.setattr(autotune, "run_trial", second_trial)
    assert autotune.within_noise(*listed) and not autotune.within_noise(listed[0], dataclasses.replace(
        listed[1], measured={"samples_per_s": 94.0}))
    ranked = autotune.confirmed(None, listed, list(listed), AutoConfig(), tmp_path, [])
    assert ranked[0].label == lead
    assert ranked[0].measured["trials_samples_per_s"] == [[100.0, 97.0][listed.index(ranked[0])],
                                                          again[listed.index(ranked[0])]]
    assert ranked[0].reason.endswith(("kept the lead on the mean of two trials" if lead == "none" else
                                      "took the lead from none on the mean of two trials"))
