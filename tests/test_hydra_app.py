"""`lightfleet` as a Hydra application, through the real command in a scratch directory: Hydra's
flags and `hydra.*` keys, a user's own config directory with a model that is not ours, Hydra's
launchers (joblib, submitit's local executor) running 2-process jobs, and the Optuna sweeper."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.user_code import USER_MODEL, USER_NET, shadowing_packages

USER_CONFIGS = {
    "model/user_net.yaml": USER_NET,
    "data/user_data.yaml": "defaults:\n  - classification\n  - _self_\nbatch_size: 32\nnum_train: 512\n",
    "experiment/user_experiment.yaml": textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /model: user_net
          - override /data: user_data
        name: user_experiment
        trainer:
          max_steps: 6
        """),
    # A primary config of the user's that starts from lightfleet's (for -cp/-cn).
    "my_primary.yaml": "defaults:\n  - lightfleet\n  - override model: user_net\n  - _self_\nname: from_my_primary\n",
}

QUICK = ("trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "trainer.num_sanity_val_steps=0")


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """The user's module beside the run (importable from where lightfleet runs) and their config dir;
    and a `plugins` package of their own, which shadows nothing of lightfleet's (their `runner/` would
    shadow `python -m runner` itself, the tests' command: tests/test_wheel.py runs `lightfleet` with one)."""
    (tmp_path / "user_model.py").write_text(USER_MODEL)
    shadowing_packages(tmp_path, "plugins")
    configs = tmp_path / "my_configs"
    for name, text in USER_CONFIGS.items():
        (configs / name).parent.mkdir(parents=True, exist_ok=True)
        (configs / name).write_text(text)
    return configs


def read(path: Path):
    return yaml.safe_load(path.read_text())


def test_hydra_show_flags(lightfleet, user_dir):
    shown = lightfleet("--cfg", "job", "-p", "model", "model=gpt")
    assert shown.returncode == 0 and shown.stdout.startswith("# @package model\n_target_: runner.models.GPTDecoder")
    hydra = lightfleet("--cfg", "hydra", "-p", "hydra.job", "--resolve")
    assert hydra.returncode == 0 and "name: lightfleet" in hydra.stdout
    info = lightfleet("--info", "searchpath", "-cd", "my_configs")
    assert info.returncode == 0 and f"file://{user_dir}" in info.stdout
    assert lightfleet("--hydra-help").stdout.startswith("Hydra (")
    assert "complete -o nospace" in lightfleet("-sc", "install=bash").stdout


@pytest.mark.slow
def test_user_config_dir_adds_options_everywhere(lightfleet, user_dir, tmp_path):
    shown = lightfleet("-cd", "my_configs", "--help").stdout
    assert "model: causal_lm, gpt, mlp, resnet, user_net, vision\n" in shown and "user_experiment" in shown
    typo = lightfleet("-cd", "my_configs", "model=user_nett")
    assert typo.returncode == 2 and "did you mean user_net?" in typo.stderr and "Traceback" not in typo.stderr
    done = lightfleet("-cd", "my_configs", "-m", "experiment=glob(user_*)", "paths.sweep_dir=sweep", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = read(tmp_path / "sweep" / "sweep.yaml")["jobs"]
    assert [job["overrides"][0] for job in jobs.values()] == ["experiment=user_experiment"]
    assert read(tmp_path / "sweep" / "0" / "config.yaml")["model"]["_target_"] == "user_model.UserNet"


@pytest.mark.slow
def test_user_model_in_two_processes_with_hydra_run_dir_chdir_and_job_name(lightfleet, user_dir, tmp_path):
    done = lightfleet("-cd", "my_configs", "experiment=user_experiment", "trainer.devices=2", "hydra.run.dir=mine",
                      "hydra.job.chdir=true", "name=${hydra:job.name}-run", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "mine"
    config = read(run / "config.yaml")
    assert config["paths"]["output_dir"] == str(run) and config["name"] == "lightfleet-run"
    assert read(run / "results.yaml")["global_step"] == 6
    assert (run / "lightfleet.log").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
    assert len(list(run.glob("logs/*/attempt_0/*/stderr.log"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "my_configs", "plugins", "user_model.py"]


@pytest.mark.slow
def test_a_users_plugins_package_beside_their_model_shadows_nothing(lightfleet, user_dir):
    planned = lightfleet("-cd", "my_configs", "model=user_net", "dry_run=true")  # the model's class is imported
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "strategies: (none)\nworld: 1 process(es)" in planned.stdout


@pytest.mark.slow
def test_user_primary_config_starts_from_lightfleets(lightfleet, user_dir, tmp_path):
    done = lightfleet("-cp", "my_configs", "-cn", "my_primary", "paths.output_dir=run", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    config = read(tmp_path / "run" / "config.yaml")
    assert config["name"] == "from_my_primary" and config["model"]["_target_"] == "user_model.UserNet"
    assert config["data"]["_target_"] == "runner.data.SyntheticClassificationData"  # lightfleet's default


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_launcher_runs_two_process_jobs_into_one_sweep_dir(lightfleet, tmp_path, launcher):
    done = lightfleet("-m", f"hydra/launcher={launcher}", "strategy=[amp],[recompute]", "trainer.devices=2",
                      "paths.sweep_dir=sweep", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "sweep"
    jobs = read(sweep / "sweep.yaml")["jobs"]
    assert sorted(jobs) == ["0", "1"] and all(job["status"] == "finished" for job in jobs.values())
    for number, strategy in (("0", "amp"), ("1", "recompute")):
        assert read(sweep / number / "plan.yaml")["strategies"] == [strategy]
        assert read(sweep / number / "results.yaml")["global_step"] == 6
        assert len(list((sweep / number).glob("logs/*/attempt_0/*/stderr.log"))) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]  # no directory per rank or per relaunch


@pytest.mark.slow
def test_optuna_sweep_of_three_trials(lightfleet, tmp_path):
    done = lightfleet("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                      "hydra.sweeper.sampler.seed=0", "model.optimizer.lr=tag(log,interval(0.001,0.3))",
                      "data.batch_size=choice(32,64)", "model.hidden_dim=range(16,48,16)",
                      "optimized_metric=val_loss", "paths.sweep_dir=sweep", *QUICK, "trainer.val_check_interval=6")
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "\x1b[" not in console and "A new study created" not in console  # Optuna's chatter: for terminals
    assert [line.startswith("lightfleet: job ") for line in console.splitlines()].count(True) == 3  # each once
    sweep = tmp_path / "sweep"
    losses = {}
    for number in range(3):
        config = read(sweep / str(number) / "config.yaml")
        assert 0.001 <= config["model"]["optimizer"]["lr"] <= 0.3 and config["data"]["batch_size"] in (32, 64)
        assert config["model"]["hidden_dim"] in (16, 32, 48)  # the Optuna sweeper takes range ends as inclusive
        losses[number] = read(sweep / str(number) / "results.yaml")["val_loss"]
    best = read(sweep / "optimization_results.yaml")
    assert math.isclose(best["best_value"], min(losses.values()), rel_tol=1e-6)


@pytest.mark.slow
def test_a_refused_trial_is_optunas_worst_and_the_sweep_goes_on_to_the_best_of_the_others(lightfleet, tmp_path):
    done = lightfleet("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=1",
                      "hydra.sweeper.sampler.seed=0", "model.hidden_dim=choice(0,16)",  # 0: refused before it starts
                      "optimized_metric=val_loss", "paths.sweep_dir=sweep", *QUICK, "trainer.val_check_interval=6")
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "sweep"
    refused = [job for job in sweep.iterdir() if (job / "refused.yaml").exists()]
    losses = [read(job / "results.yaml")["val_loss"] for job in sweep.iterdir() if (job / "results.yaml").exists()]
    assert refused and losses  # the seed gives both kinds of trial
    # A refused trial gives +inf (the sweep minimises): not a loss of 0 that would win the sweep,
    # nor a NaN on which this Optuna sweeper ends the sweep.
    assert math.isclose(read(sweep / "optimization_results.yaml")["best_value"], min(losses), rel_tol=1e-6)


@pytest.mark.slow
def test_refused_additions_and_sweeps_leave_nothing_behind(lightfleet, tmp_path):
    added = lightfleet("+trainer.max_stepz=3")
    assert added.returncode == 2 and "trainer has no key 'max_stepz' (did you mean max_steps?)" in added.stderr
    sweep = lightfleet("-m", "strategy=[amp],[atuo]")  # a job Hydra cannot compose: the sweep does not start
    assert sweep.returncode == 2 and "did you mean auto" in sweep.stderr
    both = lightfleet("hydra.run.dir=a", "paths.output_dir=b")
    assert both.returncode == 2 and "set one of them" in both.stderr
    assert list(tmp_path.iterdir()) == []


GROUPS = {"trainer": ["cpu", "gpu", "ddp"], "logger": ["csv", "tensorboard", "many", "wandb", "mlflow", "comet", "none"],
          "callbacks": ["none", "model_checkpoint", "early_stopping", "lr_monitor", "rich_progress_bar"],
          "debug": ["fdr", "overfit", "limit", "profiler"]}


@pytest.mark.parametrize("group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_group_options_are_deltas_over_the_defaults(spec_for, group, option):
    default = spec_for().cfg
    chosen = spec_for(f"{group}={option}").cfg
    if group == "callbacks" and option not in ("none", "model_checkpoint"):
        assert set(chosen.callbacks) == {"model_checkpoint", option}  # the defaults plus one
    if group == "logger" and option in ("tensorboard", "many"):
        assert "tensorboard" in chosen.logger
    if group == "trainer":
        assert chosen.trainer.max_steps == default.trainer.max_steps  # what the option does not set stays


@pytest.mark.slow
def test_debug_and_group_options_run(lightfleet, tmp_path):
    """Real runs of CPU options, several per run; each option's effect is checked."""
    limited = lightfleet("trainer=cpu", "logger=none", "callbacks=early_stopping", "debug=limit", "paths.output_dir=a")
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert read(tmp_path / "a" / "results.yaml")["global_step"] == 12  # 4 batches x 3 epochs
    assert not (tmp_path / "a" / "csv").exists()
    profiled = lightfleet("trainer=ddp", "callbacks=lr_monitor", "debug=profiler", "paths.output_dir=b",
                          "trainer.enable_progress_bar=false")
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    assert read(tmp_path / "b" / "plan.yaml")["world"]["world_size"] == 2
    assert "lr-SGD" in (tmp_path / "b" / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "FIT Profiler Report" in profiled.stdout + profiled.stderr
    fast = lightfleet("debug=fdr", "callbacks=none", "paths.output_dir=c")
    assert fast.returncode == 0, fast.stderr[-3000:]
    assert read(tmp_path / "c" / "results.yaml")["global_step"] == 1


@pytest.mark.slow
def test_missing_logger_package_is_an_error_naming_the_install(lightfleet):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    done = lightfleet("logger=wandb", "paths.output_dir=run", "trainer.max_steps=2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "logger.wandb: its package is not installed" in done.stderr and "pip install -U 'wandb" in done.stderr


@pytest.mark.slow
def test_more_gpus_than_cuda_sees_is_refused_before_any_process(lightfleet, tmp_path):
    import torch

    gpus = torch.cuda.device_count()
    done = lightfleet("trainer=gpu", f"trainer.devices={gpus + 1}") if gpus else lightfleet("trainer=gpu")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"this machine has {gpus} CUDA device(s)" in done.stderr if gpus else "no CUDA device" in done.stderr
    assert f"set trainer.devices={gpus} or fewer per node" in done.stderr if gpus else "use cpu or auto" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_quiet_console_and_a_log_file_for_every_run(lightfleet, tmp_path):
    done = lightfleet("experiment=quickstart", "paths.output_dir=run", "trainer.enable_progress_bar=false")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "strategies: (none)" and lines[-1].startswith("lightfleet: done: 60 steps in ")
    assert len(lines) == 4, done.stdout  # strategies, world, run directory, summary
    for noise in ("GPU available", "TPU available", "Tip", "LeafSpec", "tensorboard", "Warning"):
        assert noise not in done.stdout + done.stderr
    assert (tmp_path / "run" / "lightfleet.log").is_file()
    verbose = lightfleet("--verbose", "paths.output_dir=loud", "trainer.max_steps=2", "trainer.enable_progress_bar=false")
    assert "GPU available" in verbose.stdout + verbose.stderr


def metrics_rows(run: Path) -> list:
    lines = (run / "csv" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, line.split(","))) for line in lines[1:]]


def first_train_losses(run: Path) -> tuple:
    """The first logged step and the mean of the first 5 logged training losses."""
    rows = [r for r in metrics_rows(run) if r["train_loss"]][:5]
    return int(rows[0]["step"]), sum(float(r["train_loss"]) for r in rows) / len(rows)


@pytest.mark.slow
def test_resume_continues_the_step_count_and_the_loss_curve(lightfleet, tmp_path):
    quick = ("experiment=quickstart", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1")
    assert lightfleet(*quick).returncode == 0
    (first,) = list((tmp_path / "outputs").glob("*/*"))
    before = (first / "csv" / "metrics.csv").read_text()
    for command in (["resume", str(first), "hydra.run.dir=resumed"],  # the short form
                    ["ckpt_path=last", *quick, "paths.output_dir=from_last"]):
        done = lightfleet(*command, "trainer.max_steps=90", "trainer.log_every_n_steps=1")
        assert done.returncode == 0, done.stderr[-3000:]
        run = tmp_path / command[-1].split("=")[1]
        assert read(run / "config.yaml")["ckpt_path"] == str(first / "checkpoints" / "last.ckpt")  # where it came from
        assert read(run / "results.yaml")["global_step"] == 90
        step, loss = first_train_losses(run)
        assert step >= 60 and loss < 0.5 * first_train_losses(first)[1]  # the curve goes on, it does not restart
    assert (first / "csv" / "metrics.csv").read_text() == before  # the old run is left as it was


@pytest.mark.slow
def test_test_stage_eval_and_replay_write_new_directories(lightfleet, tmp_path):
    # Two whole epochs, validated at their end: the final weights are the validated ones.
    done = lightfleet("experiment=quickstart", "trainer.max_steps=64", "trainer.val_check_interval=null", "test=true",
                      "hydra.run.dir=first", "trainer.enable_progress_bar=false")
    assert done.returncode == 0, done.stderr[-3000:]
    first = read(tmp_path / "first" / "results.yaml")
    assert 0 < first["test_loss"] and first["test_acc"] > 0.6
    evaluated = lightfleet("eval", "first", "hydra.run.dir=evaluated", "test=false")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert read(tmp_path / "evaluated" / "results.yaml")["val_loss"] == pytest.approx(first["val_loss"], rel=1e-6)
    replayed = lightfleet("replay", "first", "hydra.run.dir=replayed", "trainer.enable_progress_bar=false")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    again = read(tmp_path / "replayed" / "results.yaml")
    assert again["global_step"] == first["global_step"] and again["train_loss"] == pytest.approx(first["train_loss"])
    in_place = subprocess.run([sys.executable, "-m", "runner.train", "first"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    assert in_place.returncode == 2 and "`lightfleet replay first` runs it again in a new directory" in in_place.stderr


@pytest.mark.slow
def test_resume_says_where_it_continues_counts_its_own_steps_and_refuses_a_finished_run(lightfleet, tmp_path):
    quick = ("experiment=quickstart", "trainer.enable_progress_bar=false", "trainer.max_steps=20")
    assert lightfleet(*quick, "hydra.run.dir=first").returncode == 0
    finished = lightfleet("resume", "first")
    assert finished.returncode == 2 and finished.stderr.splitlines() == [
        f"lightfleet: error: trainer.max_steps=20: ckpt_path {tmp_path / 'first' / 'checkpoints' / 'last.ckpt'} was "
        f"saved at step 20: nothing is left to train; raise it (e.g. trainer.max_steps=40)"]
    done = lightfleet("resume", "first", "trainer.max_steps=30", "hydra.run.dir=more")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"lightfleet: continuing from step 20 (checkpoint {tmp_path / 'first' / 'checkpoints' / 'last.ckpt'})" \
        in done.stdout
    assert "lightfleet: done: 10 steps (steps 21 to 30) in " in done.stdout
    assert "lightfleet: note: trainer.max_steps 20 -> 30: a learning-rate schedule over max_steps (lr_decay) now " \
           "spans 30 steps, so the steps from here on are not those of the run it continues, nor of a 30-step run " \
           "from the start (a resume with the same max_steps ends bit for bit where the run would have)" in done.stdout
    evaluated = lightfleet("eval", "more", "hydra.run.dir=evaluated")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert re.search(r"lightfleet: evaluated: val_acc [0-9.]+, val_loss [0-9.]+; run directory ", evaluated.stdout)
