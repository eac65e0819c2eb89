"""Real runs through the `lightfleet` command: single process, 2 processes over gloo, sweeps of
multi-process jobs (one directory per job, every rank logging into it), every experiment."""
from __future__ import annotations

import csv
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.probe import reads_off_logging_steps
from runner.core.paths import EXPERIMENTS_DIR

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


def fast(*extra: str) -> list:
    """Overrides that keep a real training run to a few seconds."""
    return ["trainer.max_steps=12", "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", *extra]


def read(path: Path):
    return yaml.safe_load(path.read_text())


def assert_run_dir(run: Path, ranks: int) -> dict:
    for name in ("config.yaml", "plan.yaml", "env.yaml", "build.yaml", "results.yaml", "csv/metrics.csv"):
        assert (run / name).is_file(), name
    env = read(run / "env.yaml")
    assert set(env["versions"]) == {"lightfleet", "torch", "pytorch-lightning", "hydra-core", "omegaconf"}
    assert env["git_commit"] and env["python"]
    rank_logs = sorted(run.glob("logs/*/attempt_0/*/stderr.log"))
    assert len(rank_logs) == (ranks if ranks > 1 else 0)
    return read(run / "results.yaml")


def test_single_process_run_learns(lightfleet, tmp_path):
    done = lightfleet("experiment=quickstart", "paths.output_dir=run", "trainer.enable_progress_bar=false")
    assert done.returncode == 0, done.stderr[-3000:]
    results = assert_run_dir(tmp_path / "run", ranks=1)
    assert results["global_step"] == 60 and results["val_acc"] > 0.6
    assert f"val_loss {results['val_loss']:.4g} (at step {results['val_step']})" in done.stdout  # validated at 48
    assert read(tmp_path / "run" / "config.yaml")["paths"]["output_dir"] == str(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_quickstart_trains_in_two_processes_validating_where_one_process_does(lightfleet, tmp_path):
    done = lightfleet("experiment=quickstart", "trainer.devices=2", "paths.output_dir=run",
                      "trainer.enable_progress_bar=false")
    assert done.returncode == 0, done.stderr[-3000:]
    results = assert_run_dir(tmp_path / "run", ranks=2)
    assert (results["global_step"], results["val_step"]) == (60, 48) and results["val_acc"] > 0.6


def test_two_processes_share_one_run_dir(lightfleet, tmp_path):
    done = lightfleet("experiment=mlp_ddp_amp", "paths.output_dir=run", *fast())
    assert done.returncode == 0, done.stderr[-3000:]
    assert_run_dir(tmp_path / "run", ranks=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no second directory from a relaunch
    assert read(tmp_path / "run" / "plan.yaml")["world"]["world_size"] == 2


def test_sweep_of_two_combinations_in_two_processes_skips_refused_jobs(lightfleet, tmp_path):
    """A 2-combination x 2-process sweep: a forbidden job is reported and skipped, and each job
    that runs gets exactly one directory that all its ranks log into."""
    rows = [["amp", "recompute"], ["amp", "gradient_merge", "recompute"]]
    combos = ",".join(f"[{','.join(row)}]" for row in rows) + ",[lars,lamb]"
    done = lightfleet("-m", f"strategy={combos}", "trainer.devices=2", "paths.sweep_dir=sweep",
                      *fast())
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"job {len(rows)} (strategy=[lars,lamb]" in done.stderr and "both replace the optimizer" in done.stderr
    sweep = tmp_path / "sweep"
    assert {p.name for p in sweep.iterdir()} >= {*(str(i) for i in range(len(rows) + 1)), "multirun.yaml", "sweep.yaml"}
    refused = read(sweep / str(len(rows)) / "refused.yaml")  # the refused job leaves only its reason
    assert [p.name for p in (sweep / str(len(rows))).iterdir()] == ["refused.yaml"]
    assert refused["overrides"][0] == "strategy=[lars,lamb]" and "both replace the optimizer" in refused["reason"]
    for number, row in enumerate(rows):
        results = assert_run_dir(sweep / str(number), ranks=2)
        assert results["global_step"] == 12
        assert sorted(read(sweep / str(number) / "plan.yaml")["strategies"]) == row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    # The report the sweep ends with: a row per job, the refused one with its reason.
    with open(sweep / "report.csv") as report:
        jobs = {row["job"]: row for row in csv.DictReader(report)}
    assert sorted(jobs) == ["0", "1", "2"] and "both replace the optimizer" in jobs["2"]["status"]
    assert [jobs[str(n)]["strategies"] for n in range(3)] == ["amp+recompute", "amp+gradient_merge+recompute", "lamb+lars"]
    assert all(float(jobs[str(n)]["samples_per_s"]) > 0 and jobs[str(n)]["world_size"] == "2" for n in range(2))
    assert all((sweep / plot).stat().st_size > 0 for plot in ("throughput.png", "throughput_memory.png", "loss_curves.png"))
    assert "| lamb+lars | refused:" in done.stdout


FAILING = ("+callbacks.fail._target_=tests.helpers.probe.FailingStep", "+callbacks.fail.at_step=2")
FAILED = "RuntimeError: the user's callback failed at step 2"


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(lightfleet, tmp_path):
    """Job 0 fails in the sweep's own process at step 2, the next job still runs (its callback
    would fail at a step it never reaches), the report has both, and the sweep's exit status says one failed."""
    done = lightfleet("-m", FAILING[0], "+callbacks.fail.at_step=2,100", "paths.sweep_dir=sweep", *fast())
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"lightfleet: job 0 failed: {FAILED}" in done.stderr
    failure = read(tmp_path / "sweep" / "0" / "failure.yaml")
    assert failure["status"] == "failed" and failure["exit_code"] == 1 and FAILED in failure["error"]
    assert "Traceback" in (tmp_path / "sweep" / "0" / "lightfleet.log").read_text()
    assert read(tmp_path / "sweep" / "1" / "results.yaml")["global_step"] == 12
    with open(tmp_path / "sweep" / "report.csv") as report:
        statuses = {row["job"]: row["status"] for row in csv.DictReader(report)}
    assert statuses["1"] == "ok" and statuses["0"].startswith(f"failed (exit 1): {FAILED}")
    assert [job["status"] for job in read(tmp_path / "sweep" / "sweep.yaml")["jobs"].values()] == ["failed", "finished"]


def test_refusals_are_reported_before_the_first_job_trains(tmp_path):
    done = subprocess.run([sys.executable, "-m", "runner", "-m", "strategy=[amp],[sharding,dgc],[lars,lamb]",
                           "paths.sweep_dir=sweep", "trainer.enable_progress_bar=false", "trainer.max_steps=2"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    first_job = next(i for i, line in enumerate(lines) if line.startswith("lightfleet: job 0: "))
    skipped = [i for i, line in enumerate(lines) if line.startswith("lightfleet: job") and " skipped: " in line]
    assert len([i for i in skipped if i < first_job]) == 2  # all reported first (and again at their turn)


# Experiments on the user's files; tests/test_real_models.py runs them on files it makes.
ON_FILES = ("gpt2_124m", "resnet50_fleet_collective")


def test_every_experiment_launches(lightfleet, tmp_path):
    names = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml") if p.stem not in ON_FILES)
    assert {"quickstart", "mlp_ddp_amp", "resnet_amp_recompute", "gpt_recompute_gradient_merge"} <= set(names)
    done = lightfleet("-m", f"experiment=glob(*,exclude=[{','.join(ON_FILES)}])", "paths.sweep_dir=sweep", *fast(),
                      timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = read(tmp_path / "sweep" / "sweep.yaml")["jobs"]
    assert sorted(job["overrides"][0] for job in ran.values()) == sorted(f"experiment={n}" for n in names)
    assert all(job["status"] == "finished" for job in ran.values())
    for number in ran:
        config = read(tmp_path / "sweep" / str(number) / "config.yaml")
        assert read(tmp_path / "sweep" / str(number) / "results.yaml")["global_step"] == 12, config["name"]


def test_errors_only_the_built_model_reveals_are_refused_before_any_rank_starts(lightfleet, tmp_path):
    """The model is built once on the meta device in the command: module names and the optimizer
    family a strategy needs are refused there, one line, nothing created."""
    for overrides, message in (
            (["strategy=[recompute]", "strategy.recompute.checkpoints=[blokcs.0]"],
             "strategy.recompute.checkpoints='blokcs.0': matches no module of the model; module names include "),
            (["strategy=[pipeline]", "strategy.pipeline.split_points=[blokcs.1]"],
             "strategy.pipeline.split_points=['blokcs.1']: name no module of the model"),
            (["strategy=[lars]", "model=gpt", "data=language_model"],
             "model.optimizer='AdamW': lars needs momentum SGD (torch.optim.SGD with momentum > 0)")):
        done = lightfleet(*overrides, "trainer.devices=2", "paths.output_dir=run", *fast())
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith(f"lightfleet: error: {message}") and len(done.stderr.splitlines()) == 1
        assert not (tmp_path / "run").exists()


def test_a_rank_that_refuses_stops_every_rank_with_status_2_and_its_reason(lightfleet, tmp_path):
    # 80 validation samples in batches of 64: the pipeline's micro-batches cannot hold the last 16,
    # which only the ranks see, at the first validation (training batches are whole global batches).
    done = lightfleet("strategy=[pipeline]", "data.num_val=80", "trainer.devices=2", "paths.output_dir=run",
                      *fast("trainer.val_check_interval=2"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # the command's last word names a failing rank's reason
    assert re.match(r"lightfleet: run failed: rank [01]: error: strategy.pipeline: a validation batch of 16 samples "
                    r"is not accumulate_steps \* micro_batch_size = 4 \* 16 = 64", last), last
    assert (tmp_path / "run" / "config.yaml").is_file()  # what was written stays


def test_a_failed_two_process_job_is_recorded_and_the_sweep_goes_on_and_is_never_rewritten(lightfleet, tmp_path):
    done = lightfleet("-m", FAILING[0], "+callbacks.fail.at_step=2,100", "trainer.devices=2", "paths.sweep_dir=sweep",
                      *fast())
    assert done.returncode == 1 and "Traceback" not in done.stderr
    jobs = read(tmp_path / "sweep" / "sweep.yaml")["jobs"]
    assert [job["status"] for job in jobs.values()] == ["failed", "finished"]
    assert FAILED in jobs["0"]["error"]
    before = (tmp_path / "sweep" / "sweep.yaml").read_text()
    again = lightfleet("-m", "model=mlp", "paths.sweep_dir=sweep", *fast())
    assert again.returncode == 2 and again.stderr == (f"lightfleet: error: paths.sweep_dir='{tmp_path / 'sweep'}': "
                                                      "already holds a sweep; choose another directory\n")
    assert (tmp_path / "sweep" / "sweep.yaml").read_text() == before


def test_an_error_in_the_users_code_is_one_line_naming_the_full_traceback(lightfleet, tmp_path):
    """The user's code failing mid-run: exit 1, the error in one line, its traceback in a file."""
    single = lightfleet(*FAILING, "paths.output_dir=one", *fast())
    assert single.returncode == 1 and "Traceback" not in single.stderr
    log = tmp_path / "one" / "lightfleet.log"
    assert single.stderr.strip().splitlines() == [f"lightfleet: run failed: {FAILED}; traceback in {log}"]
    assert "Traceback" in log.read_text()
    two = lightfleet(*FAILING, "trainer.devices=2", "paths.output_dir=two", *fast())
    assert two.returncode == 1 and "Traceback" not in two.stderr + two.stdout
    # Both ranks fail at step 2; the line names the first, whose traceback file it names.
    said = re.match(rf"lightfleet: run failed: rank ([01]): {FAILED}; traceback in (\S+) \(exit status by rank ",
                    two.stderr.strip().splitlines()[-1])
    assert said and said[2] == str(tmp_path / "two" / "logs" / f"traceback.rank{said[1]}.txt"), two.stderr[-2000:]
    assert "Traceback" in Path(said[2]).read_text()


def free_port() -> int:
    """A free port below the kernel's ephemeral range: every other run of the suite binds port 0
    (Lightning's launcher, torch's stores), which never hands one of these out, so none can take it
    between this check and node 0's bind."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.Random(os.getpid()).sample(range(20000, low), 50):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low}")


def test_two_nodes_rendezvous_and_keep_separate_records(tmp_path):
    """Two 'nodes' on one machine over loopback: the same command with NODE_RANK 0 and 1."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, "-m", "runner", "--verbose", "trainer.num_nodes=2", "trainer.devices=1",
               "paths.output_dir=run", *fast()]  # --verbose: Lightning's "MEMBER" lines
    nodes = [subprocess.Popen(command, cwd=tmp_path, env={**env, "NODE_RANK": str(rank)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run = tmp_path / "run"
    assert read(run / "results.yaml")["global_step"] == 12
    assert read(run / "plan.yaml")["world"] == {"devices": 1, "num_nodes": 2, "world_size": 2}
    assert (run / "nodes" / "1" / "config.yaml").is_file()
    assert "MEMBER: 1/2" in outputs[0][0] + outputs[0][1]


def test_under_torchrun_lightfleet_starts_no_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "runner", "--verbose", "trainer.devices=2", "strategy=[amp]", "paths.output_dir=run",
                           *fast()],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    assert read(run / "results.yaml")["global_step"] == 12
    assert (run / "ranks" / "1" / "config.yaml").is_file()
    assert not (run / "logs").exists()  # torchrun's processes, not ours
    logged = (done.stdout + done.stderr).splitlines()  # each rank runs the command: Hydra's job logging
    members = sorted(line.split("MEMBER: ")[1] for line in logged if "MEMBER: " in line)
    assert members == ["1/2", "2/2"]
    # rank 0 speaks for the run; rank 1 keeps its lines in its own log
    assert [line.startswith("lightfleet: done:") for line in logged].count(True) == 1
    assert logged.count("strategies: amp") == 1 and "strategies: amp" in (run / "ranks" / "1" / "lightfleet.log").read_text()


def test_pipeline_checkpoint_from_every_stage_exports_to_one_plain_file(lightfleet, tmp_path):
    """Each stage writes its own parameters (and batch-norm statistics) into the checkpoint
    directory; the export is one file that plain torch loads into the unsplit model."""
    import torch

    from runner.models import ResNetClassifier

    done = lightfleet("model=resnet", "data=images", "strategy=[pipeline]", "trainer.devices=2", "paths.output_dir=run",
                      *fast())
    assert done.returncode == 0, done.stderr[-3000:]
    exported = subprocess.run([sys.executable, "-m", "plugins.sharding", "export", "run/checkpoints/last.ckpt", "model.pt"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "model.pt", weights_only=True)
    assert checkpoint["global_step"] == 12
    model = ResNetClassifier()
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    trained = dict(model.state_dict())
    torch.manual_seed(0)  # the run's seed: its initial weights
    initial = ResNetClassifier()
    for name, tensor in initial.state_dict().items():  # both stages' weights trained, statistics updated
        if tensor.is_floating_point():
            assert not torch.equal(trained[name], tensor), name
    # Evaluated as the pipeline's refusal says: the exported file, without the pipeline.
    refused = lightfleet("eval", "run", "ckpt_path=run/checkpoints/last.ckpt", "hydra.run.dir=refused")
    assert refused.returncode == 2 and "python -m plugins.sharding export" in refused.stderr
    assert not (tmp_path / "refused").exists()
    evaluated = lightfleet("eval", "run", "strategy.pipeline=null", "trainer.devices=1", "ckpt_path=model.pt",
                           "hydra.run.dir=evaluated")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert read(tmp_path / "evaluated" / "results.yaml")["val_loss"] > 0


def test_data_that_does_not_divide_by_the_ranks_finishes_on_every_rank(lightfleet, tmp_path):
    """1001 samples over 2 ranks at batch 64: the global order (runner/data/order.py) serves whole
    global batches of 128, so both ranks take 7 batches of 64, the last 105 samples of the epoch's
    order sit it out, and neither rank waits at the last."""
    done = lightfleet("data.num_train=1001", "data.batch_size=64", "trainer.devices=2", "trainer.max_epochs=1",
                      "paths.output_dir=run", "trainer.enable_progress_bar=false", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read(tmp_path / "run" / "results.yaml")["global_step"] == 7
    assert sorted(p.parent.name for p in (tmp_path / "run" / "logs").glob("*/attempt_0/*/stderr.log")) == ["0", "1"]


def test_the_seed_decides_the_initial_weights(lightfleet, tmp_path):
    losses = {}
    for seed in (1, 2):
        done = lightfleet(f"seed={seed}", f"paths.output_dir=seed{seed}", *fast())
        assert done.returncode == 0, done.stderr[-3000:]
        losses[seed] = first_logged_loss(tmp_path / f"seed{seed}")
    assert losses[1] != losses[2]  # the data's own seed (data.seed) is the same in both


def first_logged_loss(run: Path) -> float:
    with (run / "csv" / "metrics.csv").open() as metrics:
        return next(float(row["train_loss"]) for row in csv.DictReader(metrics) if row.get("train_loss"))


def test_two_processes_validate_on_the_whole_set_and_eval_trains_nothing(lightfleet, tmp_path):
    done = lightfleet("trainer.devices=2", "paths.output_dir=trained", *fast())
    assert done.returncode == 0, done.stderr[-3000:]
    trained = read(tmp_path / "trained" / "results.yaml")
    val_loss = {}
    for devices in (1, 2):
        done = lightfleet("eval", "trained", f"trainer.devices={devices}", f"hydra.run.dir=eval{devices}")
        assert done.returncode == 0, done.stderr[-3000:]
        results = read(tmp_path / f"eval{devices}" / "results.yaml")
        assert results["global_step"] in (0, trained["global_step"]) and "train_loss" not in results
        assert not (tmp_path / f"eval{devices}" / "checkpoints").exists()
        val_loss[devices] = results["val_loss"]
    # 512 validation samples, 4 batches of 64 on each of 2 ranks: the mean over both ranks is the
    # mean over the whole set, which one process computes alone.
    assert val_loss[2] == pytest.approx(val_loss[1], rel=1e-5)


def test_no_micro_batch_reads_a_value_off_the_device_only_logging_steps_do(lightfleet, tmp_path):
    # A plain loop on a GPU reads nothing back from the device per micro-batch; a progress bar or a
    # logger that did (an .item() of the loss) would make the host wait for the device every time.
    k, every = 4, 3
    done = lightfleet("strategy=[gradient_merge]", f"strategy.gradient_merge.k_steps={k}", "trainer.max_steps=7",
                      f"trainer.log_every_n_steps={every}",
                      "+callbacks.syncs._target_=tests.helpers.probe.SynchronisingCalls", "paths.output_dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train_loss=" in done.stdout  # the bar still shows the loss (read at logging steps)
    windows = json.loads((tmp_path / "run" / "syncs.json").read_text())  # [step at the batch's start, calls]
    assert len(windows) == 7 * k - 1
    assert reads_off_logging_steps(windows, k, every) == {}
    assert 0 < max(calls for _, calls in windows) <= 4  # at logging steps: the bar's loss and the logger's
