"""Resume on another number of processes (issue 41): `lightfleet resume RUN trainer.devices=M`
keeps the checkpoint's global batch G = data-parallel processes x micro-batch x accumulation by
setting the accumulation through the strategies' knob, says both worlds in one plan line, and
refuses before any process starts where no whole accumulation keeps G
(runner/command/resume_world.py).

The slow tests are the issue's faults, reproduced as it found them (quickstart interrupted
mid-epoch by SIGTERM, resumed with trainer.devices=M) and sharing their runs: before the
command set the accumulation, 2 -> 1 silently halved the global batch (64 samples a step), 1 -> 2
doubled it, and sharding stage 3 resumed 1 -> 2 ended the epoch early. The fast ones plan resumes
of checkpoints crafted with a record (the quickstart MLP's weights, zeros), in this process.
"""
from __future__ import annotations

import csv
import shutil
import signal
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import yaml

from omegaconf import OmegaConf

from runner.command import cli, preflight
from runner.config.compose import CONFIG_NAME
from runner.core.errors import ConfigError
from runner.rank.parent import PREEMPTED
from tests.helpers.preemption import REACHED, RUN, start, wait_for
from tests.helpers.probe import samples_per_step

SAMPLE_IDS = "+callbacks.ids._target_=tests.helpers.probe.SampleIds"
QUIET = "trainer.enable_progress_bar=false"
SHARDING_3 = ("strategy=[sharding]", "strategy.sharding.stage=3")


# --- the faults, through the real command -------------------------------------------

def interrupted(folder: Path, name: str, *overrides: str) -> int:
    """The quickstart (RUN: 40 steps) stopped by SIGTERM after step 3; the step it saved."""
    process = start(folder, "experiment=quickstart", SAMPLE_IDS, *overrides, f"paths.output_dir={name}")
    wait_for(folder / name / REACHED, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED, err[-3000:]
    return last_checkpoint(folder / name)["global_step"]


def epochs(run: Path) -> Dict[int, int]:
    """The epoch of every logged step (log_every_n_steps=1)."""
    rows = csv.DictReader((run / "csv" / "metrics.csv").open())
    return {int(row["step"]): int(row["epoch"]) for row in rows if row["train_loss"]}


def last_checkpoint(run: Path) -> Dict[str, Any]:
    """The run's last.ckpt without its tensors: a file, or a distributed checkpoint's meta.pt."""
    last = run / "checkpoints" / "last.ckpt"
    return torch.load(last / "meta.pt" if last.is_dir() else last, map_location="cpu", mmap=not last.is_dir(),
                      weights_only=True)


def record(run: Path) -> Dict[str, Any]:
    return last_checkpoint(run)["lightfleet"]


@pytest.fixture(scope="module")
def runs(lightfleet_in, tmp_path_factory) -> Dict[str, Any]:
    """Uninterrupted 2-process runs (global batch 128: plain and sharding stage 3) and the
    interrupted ones, each resumed on the other number of processes: 2 -> 1, and 1 -> 2 from a
    1-process run accumulating 2 micro-batches (the same global batch)."""
    folder = tmp_path_factory.mktemp("resume_world")
    found: Dict[str, Any] = {"folder": folder}
    for name, overrides in (("full", ()), ("full_sharded", SHARDING_3)):
        done = lightfleet_in(folder, *RUN, "experiment=quickstart", SAMPLE_IDS, "trainer.devices=2", *overrides,
                             f"paths.output_dir={name}", QUIET, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    for name, overrides, resumed_on in (
            ("two", ("trainer.devices=2",), 1),
            ("one", ("trainer.devices=1", "trainer.accumulate_grad_batches=2"), 2),
            ("one_sharded", ("trainer.devices=1", *SHARDING_3, "strategy.sharding.gradient_merge_acc_step=2"), 2)):
        found[f"{name}_step"] = interrupted(folder, name, *overrides)
        found[name] = lightfleet_in(folder, "resume", name, f"trainer.devices={resumed_on}",
                                    f"paths.output_dir={name}_resumed", QUIET, timeout=600)
    return found


def assert_same_samples(runs: Dict[str, Any], name: str, full: str) -> None:
    """Every step from the resumed one on trained on the uninterrupted run's samples, 128 a step."""
    folder, step = runs["folder"], runs[f"{name}_step"]
    resumed, uninterrupted = samples_per_step(folder / f"{name}_resumed"), samples_per_step(folder / full)
    assert sorted(resumed) == list(range(step, 40))
    assert all(sum(resumed[s].values()) == 128 for s in resumed), {s: sum(c.values()) for s, c in resumed.items()}
    assert resumed == {s: ids for s, ids in uninterrupted.items() if s >= step}


@pytest.mark.slow
def test_two_processes_resumed_on_one_keep_the_global_batch(runs):
    done, folder = runs["two"], runs["folder"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert 3 <= runs["two_step"] < 16  # mid-epoch: 2048 samples are 16 global batches of 128
    resumed = folder / "two_resumed"
    assert record(resumed)["world"]["processes"] == 1 and record(resumed)["batch"]["global"] == 128
    assert_same_samples(runs, "two", "full")
    assert epochs(resumed) == {s: e for s, e in epochs(folder / "full").items() if s >= runs["two_step"]}
    assert ("note: resume on another world: 2 processes (2 data-parallel) x micro-batch 64 x accumulation 1 = "
            "global batch 128 -> 1 process (1 data-parallel) x 64 x 2 (trainer.accumulate_grad_batches=2)"
            ) in done.stdout.splitlines()
    assert yaml.safe_load((resumed / "config.yaml").read_text())["trainer"]["accumulate_grad_batches"] == 2


@pytest.mark.slow
def test_one_process_resumed_on_two_keeps_the_global_batch(runs):
    done, folder = runs["one"], runs["folder"]
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = folder / "one_resumed"
    assert record(resumed)["world"]["processes"] == 2 and record(resumed)["batch"]["global"] == 128
    assert_same_samples(runs, "one", "full")
    assert epochs(resumed) == {s: e for s, e in epochs(folder / "full").items() if s >= runs["one_step"]}
    assert "note: resume on another world: 1 process (1 data-parallel) x micro-batch 64 x accumulation 2 = " \
           "global batch 128 -> 2 processes (2 data-parallel) x 64 x 1 (trainer.accumulate_grad_batches=1)" in done.stdout


@pytest.mark.slow
def test_sharding_stage_3_resumed_on_two_ends_the_epoch_where_the_uninterrupted_run_does(runs):
    done, folder = runs["one_sharded"], runs["folder"]
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = folder / "one_sharded_resumed"
    # The epoch ends at step 16 (2048 samples in global batches of 128), as in the uninterrupted run.
    logged = epochs(resumed)
    assert logged == {s: e for s, e in epochs(folder / "full_sharded").items() if s >= runs["one_sharded_step"]}
    assert logged[15] == 0 and logged[16] == 1
    assert_same_samples(runs, "one_sharded", "full_sharded")
    assert "(strategy.sharding.gradient_merge_acc_step=1)" in done.stdout
    assert yaml.safe_load((resumed / "config.yaml").read_text())["strategy"]["sharding"]["gradient_merge_acc_step"] == 1


@pytest.mark.slow
def test_a_process_count_that_keeps_no_global_batch_is_refused_before_anything_starts(runs, lightfleet_in):
    folder = runs["folder"]
    done = lightfleet_in(folder, "resume", "two", "trainer.devices=3", "paths.output_dir=three")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "lightfleet: error: trainer.devices=3: the checkpoint's global batch of 128 (2 processes (2 data-parallel) x "
        "micro-batch 64 x accumulation 1) is no whole multiple of 3 data-parallel process(es) x micro-batch 64; use "
        "trainer.devices=1 or 2"]
    assert not (folder / "three").exists()


# --- planned in this process, for run directories crafted with a checkpoint's record -----------

def checked(*overrides: str, config_name: str = CONFIG_NAME) -> preflight.Flight:
    """The command's job stages on these overrides, as for a single run."""
    return preflight.check_job(preflight.compose(list(overrides), None, config_name))


def a_record(processes: int, data_parallel: int, micro: int, accumulation: int, order: str = "global") -> dict:
    """A checkpoint's record (runner/rank/resume.py:GlobalPosition), 4 steps into epoch 0."""
    global_batch = data_parallel * micro * accumulation
    return {"world": {"processes": processes, "nodes": 1, "data_parallel": data_parallel},
            "batch": {"global": global_batch, "micro": micro, "accumulation": accumulation, "loader": micro,
                      "accumulate_grad_batches": accumulation},
            "data": {"order": order, "epoch": 0, "epoch_finished": False, "steps_in_epoch": 4,
                     "samples": 4 * global_batch}}


@pytest.fixture
def saved_run(tmp_path):
    """saved_run(record, *overrides): a run directory as the command leaves one (config.yaml and
    plan.yaml of `overrides`), with a checkpoints/last.ckpt at step 4 of its model's weights (zeros)
    holding `record` (None: none, as before checkpoints held one)."""
    def make(written: Any, *overrides: str) -> Path:
        run = tmp_path / "run"
        (run / "checkpoints").mkdir(parents=True)
        flight = checked(*overrides, "dry_run=true")
        OmegaConf.save(flight.spec.cfg, run / "config.yaml", resolve=True)
        (run / "plan.yaml").write_text(yaml.safe_dump(flight.plan.to_dict()))
        weights = {key: torch.zeros(value.shape) for key, value in flight.model.state_dict().items()}
        torch.save({"global_step": 4, "state_dict": weights, **({"lightfleet": written} if written else {})},
                   run / "checkpoints" / "last.ckpt")
        return run
    return make


def resumed(run: Path, *overrides: str) -> preflight.Flight:
    """`lightfleet resume RUN *overrides`, planned in this process."""
    _, config_name, *args = cli.from_run_dir("resume", [str(run), *overrides])
    return checked(*args, config_name=config_name)


def test_a_resume_on_one_process_sets_lightnings_accumulation_and_says_both_worlds(saved_run):
    run = saved_run(a_record(2, 2, 64, 1), "experiment=quickstart", "trainer.devices=2")
    flight = resumed(run, "trainer.devices=1")
    assert flight.spec.cfg.trainer.accumulate_grad_batches == flight.spec.trainer.accumulate_grad_batches == 2
    assert flight.plan.notes[-1] == (
        "resume on another world: 2 processes (2 data-parallel) x micro-batch 64 x accumulation 1 = global batch "
        "128 -> 1 process (1 data-parallel) x 64 x 2 (trainer.accumulate_grad_batches=2)")
    same = resumed(run)
    assert same.spec.trainer.accumulate_grad_batches == 1 and not any("another world" in n for n in same.plan.notes)


@pytest.mark.parametrize("selection, saved, knob, kept", [
    (("strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=2"), (2, 2, 64, 2), "strategy.gradient_merge.k_steps", 4),
    (SHARDING_3, (2, 2, 64, 1), "strategy.sharding.gradient_merge_acc_step", 2),
    (("strategy=[sharding]", "trainer.accumulate_grad_batches=2"), (2, 2, 64, 2), "trainer.accumulate_grad_batches", 4),
], ids=["gradient_merge", "sharding", "sharding_beside_lightnings"])
def test_each_strategy_keeps_the_global_batch_through_its_own_knob(saved_run, selection, saved, knob, kept):
    # (without validation: quickstart's val_check_interval of 16 steps is more than an epoch of 256-sample steps)
    flight = resumed(saved_run(a_record(*saved), "experiment=quickstart", "trainer.devices=2", "trainer.limit_val_batches=0",
                               *selection), "trainer.devices=1")
    assert OmegaConf.select(flight.spec.cfg, knob) == kept
    assert flight.plan.notes[-1].endswith(f"x 64 x {kept} ({knob}={kept})")
    accumulation = flight.plan.trainer_args.get("accumulate_grad_batches", {}).get("value")
    assert (accumulation or flight.spec.trainer.accumulate_grad_batches) == kept


def test_the_pipeline_keeps_its_micro_batch_and_changes_its_micro_batches_per_step(saved_run, tmp_path):
    # gpt_pipeline_1f1b: 2 stages on 2 processes, 4 micro-batches of 8 a step: global batch 32. On 4
    # processes, two replicas of the two stages: 2 micro-batches of 8 each, loader batches of 16.
    stages = ("experiment=gpt_pipeline_1f1b", "strategy=[pipeline,sharding]", "strategy.sharding.pp_degree=2")
    flight = resumed(saved_run(a_record(2, 1, 8, 4), *stages), "trainer.devices=4")
    pipeline = flight.spec.strategies["pipeline"]
    assert (pipeline.accumulate_steps, pipeline.micro_batch_size, flight.spec.cfg.data.batch_size) == (2, 8, 16)
    assert flight.plan.notes[-1] == (
        "resume on another world: 2 processes (1 data-parallel) x micro-batch 8 x accumulation 4 = global batch 32 "
        "-> 4 processes (2 data-parallel) x 8 x 2 (strategy.pipeline.accumulate_steps=2)")
    # 2 micro-batches a step (global batch 16): two replicas would take 1 each, and 1F1B needs 2 for 2 stages.
    shutil.rmtree(tmp_path / "run")
    run = saved_run(a_record(2, 1, 8, 2), *stages, "strategy.pipeline.accumulate_steps=2", "data.batch_size=16")
    with pytest.raises(ConfigError, match=r"^trainer.devices=4: the checkpoint's global batch of 16 .* needs "
                                          r"strategy.pipeline.accumulate_steps=1 on 2 data-parallel .*1F1B needs >= 2 "
                                          r"micro-batches.*; use trainer.devices=2$"):
        resumed(run, "trainer.devices=4")


@pytest.mark.parametrize("saved, devices, working", [((1, 1, 64, 1), 2, "trainer.devices=1"),
                                                     ((2, 2, 64, 1), 3, "trainer.devices=1 or 2")])
def test_a_world_no_whole_accumulation_fits_is_refused_naming_those_that_do(saved_run, saved, devices, working):
    run = saved_run(a_record(*saved), "experiment=quickstart", f"trainer.devices={saved[0]}")
    with pytest.raises(ConfigError, match=rf"^trainer.devices={devices}: the checkpoint's global batch of "
                                          rf"{saved[2] * saved[1]} .* is no whole multiple of {devices} data-parallel "
                                          rf"process\(es\) x micro-batch 64; use {working}$"):
        resumed(run, f"trainer.devices={devices}")


def test_an_explicit_accumulation_is_taken_when_it_keeps_the_global_batch_and_refused_when_not(saved_run):
    run = saved_run(a_record(2, 2, 64, 1), "experiment=quickstart", "trainer.devices=2")
    assert resumed(run, "trainer.devices=1", "trainer.accumulate_grad_batches=2").spec.trainer.accumulate_grad_batches == 2
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches=4: gives a global batch of 256 on 1 "
                                          r"data-parallel process\(es\) x micro-batch 64, not the checkpoint's global "
                                          r"batch of 128 .*: use trainer.accumulate_grad_batches=2$"):
        resumed(run, "trainer.devices=1", "trainer.accumulate_grad_batches=4")


def test_a_position_per_rank_is_refused_on_another_world(saved_run, tmp_path):
    run = saved_run(a_record(2, 2, 64, 1, order="loader"), "experiment=quickstart", "trainer.devices=2")
    with pytest.raises(ConfigError, match=r"^trainer.devices=1: .* a sampler of its own, whose position in the epoch "
                                          r"is per rank: resume it on 2 process\(es\), or give the data module's "
                                          r"train_dataloader `sampler=global_order\(self.trainer, dataset, B\)`"):
        resumed(run, "trainer.devices=1")
    assert resumed(run).start_step == 4
    # Written before checkpoints held a record: the run's plan.yaml says the world it was written on.
    shutil.rmtree(run)
    run = saved_run(None, "experiment=quickstart", "trainer.devices=2")
    with pytest.raises(ConfigError, match=r"^trainer.devices=1: .* holds no record of its global batch .*: its "
                                          r"position in the epoch is per rank, for the 2 process\(es\) of its run"):
        resumed(run, "trainer.devices=1")
    assert resumed(run).start_step == 4


def test_processes_on_several_nodes_count_in_all(saved_run, monkeypatch):
    for variable, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0")):
        monkeypatch.setenv(variable, value)
    run = saved_run(a_record(2, 2, 64, 1), "experiment=quickstart", "trainer.devices=2")
    on_two_nodes = resumed(run, "trainer.devices=1", "trainer.num_nodes=2")  # the same 2 processes
    assert on_two_nodes.spec.trainer.accumulate_grad_batches == 1
    assert not any("another world" in note for note in on_two_nodes.plan.notes)
    with pytest.raises(ConfigError, match=r"^trainer.devices=2: .* no whole multiple of 4 data-parallel process\(es\) "
                                          r"x micro-batch 64; use trainer.devices=1 \(per node, on 2 nodes\)$"):
        resumed(run, "trainer.devices=2", "trainer.num_nodes=2")


@pytest.mark.slow
def test_a_run_ended_by_max_steps_midway_goes_on_in_its_epoch_validating_at_the_same_steps(lightfleet_in, tmp_path):
    """A last.ckpt written as fit ends (max_steps=20, in the second epoch) resumed on 1 process
    with max_steps=40: Lightning counts that epoch done, and the resumed run trained the next
    epoch's samples (4e-2 from the uninterrupted run's parameters). Now it trains the uninterrupted
    run's samples at every step, validates every 16 optimizer steps (trainer.val_check_interval
    counts steps: 32 micro-batches of the 1-process run), and its bar counts the epoch's steps."""
    for name, steps in (("full", 40), ("first", 20)):
        done = lightfleet_in(tmp_path, "experiment=quickstart", SAMPLE_IDS, "trainer.devices=2", f"trainer.max_steps={steps}",
                             "trainer.log_every_n_steps=1", f"paths.output_dir={name}", QUIET, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    done = lightfleet_in(tmp_path, "resume", "first", "trainer.devices=1", "trainer.max_steps=40", "paths.output_dir=more",
                         "trainer.enable_progress_bar=true", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, uninterrupted = samples_per_step(tmp_path / "more"), samples_per_step(tmp_path / "full")
    assert sorted(resumed) == list(range(20, 40)) and resumed == {s: ids for s, ids in uninterrupted.items() if s >= 20}
    # the validation after step 32 (at the end of the second epoch), in the row Lightning names step 31
    assert validated(tmp_path / "more") == [step for step in validated(tmp_path / "full") if step >= 20] == [31]
    assert "Epoch 2, step: 100%" in done.stdout and "40/40" in done.stdout, done.stdout[-2000:]


def validated(run: Path) -> list:
    """The steps at which the run logged a validation loss."""
    rows = csv.DictReader((run / "csv" / "metrics.csv").open())
    return [int(row["step"]) for row in rows if row.get("val_loss")]
