"""strategy=[auto] with strategy.auto.mode=rehearse (issue 42, part "auto"): every candidate the
table allows rehearsed at the requested world (4 GPUs of an H100 kind on a machine without any),
ranked by its rehearsal's fit and predicted samples/s; nothing trains here.

One real rehearsal of a one-block MLP serves the slow tests (module fixture `rehearsed`). Its device
is made small, 0.03 GiB with no reserve but the fragmentation's, so that plain DDP (rehearsed peak
about 34 MiB: parameters, gradients and momentum whole, 8 MiB each) does not fit and sharding
stage 2 (optimizer states and gradients a quarter each: about 24 MiB) does.
"""
from __future__ import annotations

import csv
import signal
import time

import pytest
import yaml

from runner.command.autotune import JUDGES
from runner.rank.parent import exit_status
from runner.strategies.auto import MODES
from tests.helpers.preemption import rank_pids, start, wait_for, wait_gone

ARGS = ("strategy=[auto]", "strategy.auto.mode=rehearse", "trainer.accelerator=gpu", "trainer.devices=4",
        "model.num_blocks=1", "model.hidden_dim=1024", "rehearse.device=h100", "rehearse.device_memory_gb=0.03",
        "rehearse.reserve_context_gb=0", "rehearse.reserve_nccl_gb=0", "trainer.enable_progress_bar=false")
# The candidates the table allows this model at 4 processes on an H100 (amp in bfloat16: the
# device's; no recompute or pipeline: the model has no repeated block list), written out here.
EXPECTED = {"none", "sharding(stage=1)", "sharding(stage=2)", "sharding(stage=3)", "amp(dtype=bfloat16)",
            "amp(dtype=bfloat16)+sharding(stage=1)", "amp(dtype=bfloat16)+sharding(stage=2)",
            "amp(dtype=bfloat16)+sharding(stage=3)"}
COST = "auto (rehearse): 8 candidates to rehearse at 4 processes for h100 (0.03 GiB), 8 rank kinds"


def test_every_mode_has_a_judge():
    """One orchestration: each mode is a judge of the candidates, none a branch of its own."""
    assert set(JUDGES) == set(MODES)


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory, lightfleet_in):
    cwd = tmp_path_factory.mktemp("auto_rehearse")
    done = lightfleet_in(cwd, *ARGS, "paths.output_dir=run", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    auto = cwd / "run" / "auto"
    with (auto / "candidates.csv").open() as table:
        rows = {row["strategies"]: row for row in csv.DictReader(table)}
    return cwd, done, auto, rows


@pytest.mark.slow
def test_the_cost_is_said_before_any_rank_is_rehearsed(rehearsed):
    _, done, _, rows = rehearsed
    assert set(rows) == EXPECTED
    assert COST in done.stdout
    first_rank = done.stdout.index("auto:   rank 0 (")
    assert done.stdout.index(COST) < first_rank
    for label in EXPECTED:  # each rehearsed once, its rehearsal line after the cost line
        assert f"/8 {label}: " in done.stdout[first_rank:]


@pytest.mark.slow
def test_plain_ddp_does_not_fit_and_is_left_out_with_its_peak(rehearsed):
    _, done, auto, rows = rehearsed
    plain = rows["none"]
    assert plain["status"] == "does not fit"
    assert "rank 0 (dp_replicate 4) needs " in plain["reason"] and "(peak " in plain["reason"]
    assert int(plain["rehearsed_needs_bytes"]) > 0.03 * 2**30 > int(rows["sharding(stage=2)"]["rehearsed_needs_bytes"])
    assert rows["sharding(stage=2)"]["status"] == "fits"
    for row in rows.values():  # every candidate rehearsed: its peak, and a prediction for the H100
        assert int(row["rehearsed_peak_bytes"]) > 0 and float(row["rehearsed_predicted_samples_per_s"]) > 0
    choice = yaml.safe_load((auto / "choice.yaml").read_text())
    assert choice["mode"] == "rehearse" and choice["strategies"]["sharding"]["stage"] in (2, 3)
    assert rows[choice["chosen"]]["status"] == "fits"
    # Sharding is taken because without it the winner's rehearsal does not fit, said with that peak.
    assert choice["why"]["sharding"].startswith("taken: without it, rank 0 (dp_replicate 4) needs ")
    assert f"auto (rehearse): chose {choice['chosen']}: rehearsed peak " in done.stdout
    assert "do not fit by their rehearsal" in choice["verdict"][0]
    # Chosen for a cluster: nothing trained here, and the command to run there said.
    assert f"nothing trains here; on the cluster run: lightfleet --config-dir {auto} experiment=best" in done.stdout
    assert not (auto.parent / "results.yaml").exists() and not (auto.parent / "checkpoints").exists()


@pytest.mark.slow
def test_the_winners_best_yaml_reruns(rehearsed, lightfleet_in):
    """best.yaml alone: rehearsed again for the cluster it fits, and trained on this machine's CPUs."""
    cwd, _, auto, _ = rehearsed
    choice = yaml.safe_load((auto / "choice.yaml").read_text())
    again = lightfleet_in(cwd, "rehearse", "--config-dir", str(auto), "experiment=best", "paths.output_dir=again",
                          *ARGS[-4:], timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "lightfleet: every kind of rank fits h100's 0.03 GiB" in again.stdout
    plan = yaml.safe_load((cwd / "again" / "plan.yaml").read_text())
    assert plan["world"]["world_size"] == 4 and set(plan["strategies"]) == set(choice["strategies"])
    here = lightfleet_in(cwd, "--config-dir", str(auto), "experiment=best", "trainer.accelerator=cpu",
                         "trainer.devices=2", "trainer.max_steps=2", "paths.output_dir=trained", timeout=300)
    assert here.returncode == 0, here.stderr[-3000:]
    assert "lightfleet: done: " in here.stdout
    trained = yaml.safe_load((cwd / "trained" / "plan.yaml").read_text())
    assert "sharding" in trained["strategies"]


def test_dry_run_says_the_cost_and_rehearses_nothing(lightfleet, tmp_path):
    done = lightfleet(*ARGS, "dry_run=true", "paths.output_dir=dry")
    assert done.returncode == 0, done.stderr[-3000:]
    assert COST in done.stdout and done.stdout.rstrip().endswith("dry_run=true rehearses none")
    assert "auto:   rank" not in done.stdout and not (tmp_path / "dry").exists()


def test_a_world_this_machine_lacks_is_planned_not_refused(lightfleet):
    """16 GPUs on 2 nodes, without a GPU or the nodes' rendezvous variables: as `lightfleet rehearse`."""
    done = lightfleet(*ARGS[:-3], "trainer.num_nodes=2", "trainer.devices=8", "dry_run=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world: 16 process(es) = 8 per node x 2 node(s)" in done.stdout
    assert "candidates to rehearse at 16 processes for h100" in done.stdout


@pytest.mark.slow
def test_sigterm_while_rehearsing_ends_the_rehearsed_ranks_with_the_command(tmp_path):
    """A signal to a fresh command while a candidate's rank is rehearsed: that rank's process ends with
    the command, which says so in one line and trains nothing."""
    run = tmp_path / "run"
    process = start(tmp_path, *ARGS, "paths.output_dir=run")
    wait_for(run / "auto" / "rehearsals" / "0" / "rehearse" / "rank-0.log", process)
    deadline = time.monotonic() + 60
    while not (ranks := rank_pids(process.pid)):
        assert process.poll() is None and time.monotonic() < deadline, "no rank was rehearsed"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=90)
    assert process.returncode == exit_status(signal.SIGTERM), err
    assert err.strip().splitlines()[-1] == (f"lightfleet: stopped by SIGTERM in strategy=[auto]'s rehearse, nothing "
                                            f"trained; its rehearsals so far: {run / 'auto' / 'rehearsals'}")
    wait_gone(ranks, within=30)
    assert not (run / "auto" / "choice.yaml").exists() and not (run / "results.yaml").exists()


def test_lightfleet_rehearse_of_auto_points_to_the_mode(lightfleet, tmp_path):
    """`lightfleet rehearse` rehearses one plan; auto's is not chosen yet: refused, naming the mode."""
    done = lightfleet("rehearse", "strategy=[auto]", "trainer.devices=2", "paths.output_dir=refused")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("lightfleet: error: strategy='[auto]': lightfleet rehearse rehearses one plan")
    assert "strategy.auto.mode=rehearse" in done.stderr and not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_when_no_candidate_fits_the_one_needing_least_is_named_in_one_line(lightfleet, tmp_path):
    """One process and a batch of one (no sharding, no gradient merging: plain and amp), 1 MiB: both
    rehearsed, neither fits; exit status 2."""
    done = lightfleet(*ARGS[:3], "trainer.devices=1", *ARGS[4:7], "rehearse.device_memory_gb=0.001", *ARGS[8:],
                      "data.batch_size=1", "paths.output_dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "auto (rehearse): 2 candidates to rehearse at 1 processes" in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightfleet: error: rehearse.device_memory_gb=0.001: no candidate "
                                                   "fits: the one that needs least, "), lines
    assert "rank 0 (one process) needs " in lines[0] and lines[0].count("device_memory_gb") == 1
    assert not (tmp_path / "run" / "auto" / "choice.yaml").exists()
    # Each candidate's verdict is kept: candidates.csv (it was not written when none fitted).
    with (tmp_path / "run" / "auto" / "candidates.csv").open() as table:
        rows = list(csv.DictReader(table))
    assert len(rows) == 2 and {row["status"] for row in rows} == {"does not fit"}
    assert all("needs " in row["reason"] and int(row["rehearsed_needs_bytes"]) > 2**20 for row in rows)
