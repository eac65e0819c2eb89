"""The command's contract for bad input: one line on stderr, exit 2, no traceback, nothing lost,
and no heavy import before the decision."""
from __future__ import annotations

import csv
import itertools
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import yaml

from runner import strategies
from runner.command import usage

HEAVY = ("torch", "pytorch_lightning", "lightning_fabric")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def decide_in_process(*args: str, heavy=HEAVY + ("hydra", "omegaconf")) -> str:
    """Run main() in a fresh interpreter; return which heavy modules it imported before exiting."""
    code = ("import sys\nfrom runner.command.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 2, e.code\n"
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_refused_combination_exits_2_before_hydra_or_torch(lightfleet):
    done = lightfleet("strategy=[lars,lamb]")
    assert_one_line_error(done, "lightfleet: refused: lars+lamb is not an allowed combination",
                          "both replace the optimizer", "closest allowed: amp+lamb, amp+lars")
    assert decide_in_process("strategy=[lars,lamb]") == ""


def test_auto_beside_another_strategy_is_refused_in_one_line(lightfleet):
    assert_one_line_error(lightfleet("strategy=[amp,auto]"), "lightfleet: refused: amp+auto: auto must be used alone")


def test_pipeline_with_sharding_stage_2_is_refused_with_the_reason(lightfleet):
    assert_one_line_error(lightfleet("strategy=[pipeline,sharding]", "strategy.sharding.stage=2",
                                     "strategy.sharding.pp_degree=2", "trainer.devices=4"),
                          "strategy.sharding.stage=2: with pipeline only stage 1: pipeline stages keep their "
                          "parameters whole, and stages 2 and 3 would gather them again for every micro-batch")


def test_degree_product_is_checked_before_any_process_starts(lightfleet, tmp_path):
    done = lightfleet("strategy=[sharding]", "trainer.devices=2", "strategy.sharding.dp_degree=2",
                      "strategy.sharding.degree=2", "paths.output_dir=run")
    assert_one_line_error(done, "strategy.sharding.degree=2: dp_degree x degree x mp_degree x pp_degree = "
                                "2 x 2 x 1 x 1 = 4, but the run has 2 process(es)")
    assert not (tmp_path / "run").exists()


def test_unknown_strategy_suggests_a_name(lightfleet):
    assert_one_line_error(lightfleet("strategy=[amp,recomput]"), "strategy='recomput'", "did you mean recompute")


def test_typo_in_a_knob(lightfleet):
    assert_one_line_error(lightfleet("strategy=[amp]", "strategy.amp.init_los_scaling=1"),
                          "strategy.amp.init_los_scaling", "did you mean init_loss_scaling")
    assert decide_in_process("strategy=[amp]", "strategy.amp.init_los_scaling=1", heavy=HEAVY) == ""


@pytest.mark.parametrize("override, fragment", [
    ("strategy.amp.incr_ratio=1", "strategy.amp.incr_ratio=1.0: must be > 1"),
    ("strategy.amp.decr_ratio=1", "strategy.amp.decr_ratio=1.0: must be in (0, 1)"),
    ("strategy.amp.incr_every_n_steps=many", "strategy.amp.incr_every_n_steps='many'"),
])
def test_bad_values(lightfleet, override, fragment):
    assert_one_line_error(lightfleet("strategy=[amp]", override), fragment)


def test_bad_value_in_gradient_merge(lightfleet):
    assert_one_line_error(lightfleet("strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=0"),
                          "strategy.gradient_merge.k_steps=0: must be >= 1")


@pytest.mark.parametrize("overrides, message", [
    (("data.batch_size=-8",), "data.batch_size=-8: must be >= 1"),
    (("data.num_workers=-1",), "data.num_workers=-1: must be >= 0"),
    (("data.input_shape=[32,0]",), "data.input_shape[1]=0: must be >= 1"),
    (("model.hidden_dim=0",), "model.hidden_dim=0: must be >= 1"),
    (("data=imagefolder", "data.root=/nonexistent"),
     "data.root='/nonexistent': no such folder (train/ and val/ folders of class folders under it)"),
    (("data=imagefolder",), "data.root: is required: set data.root=... on the command line or in an experiment"),
    (("model=causal_lm", "data=tokens", "data.train_bin=missing.bin", "data.val_bin=missing.bin"),
     "data.train_bin='missing.bin': no such file (a flat file of uint16 token ids"),
    (("model=causal_lm", "data=hf_text", "data.path=nowhere", "data.tokenizer=nowhere.json"),
     "data.path='nowhere': no such file or directory (text, parquet or jsonl files"),
    (("model=causal_lm", "data=tokens", "data.train_bin=.", "data.val_bin=."),
     "data.train_bin='.': is a folder, not a file (a flat file of uint16 token ids"),
], ids=["batch_size", "num_workers", "input_shape", "model_size", "imagefolder_root", "root_not_given", "token_file",
         "hf_text_path", "folder_for_a_file"])
def test_a_bad_count_or_path_of_the_built_in_model_and_data_is_refused_before_torch(lightfleet, overrides, message):
    """As fast as the table's refusal: neither torch nor Lightning is imported, nothing is built."""
    assert_one_line_error(lightfleet(*overrides), f"lightfleet: error: {message}")
    assert decide_in_process(*overrides, heavy=HEAVY) == ""


def test_a_validation_interval_longer_than_each_processs_epoch_is_refused_before_lightning(lightfleet):
    """2048 samples in global batches of 2 x 64 are 16 optimizer steps an epoch (the interval counts
    optimizer steps): Lightning would refuse an interval of 30 in every rank once they had started."""
    command = ("experiment=quickstart", "trainer.devices=2", "trainer.val_check_interval=30")
    assert_one_line_error(lightfleet(*command), "lightfleet: error: trainer.val_check_interval=30: more than the 16 "
                          "optimizer steps of an epoch (data.num_train=2048 in global batches of 128 = 2 data-parallel "
                          "process(es) x data.batch_size=64 x 1 accumulated): at most 16, or "
                          "trainer.check_val_every_n_epoch=null to count steps across epochs")
    assert decide_in_process(*command, heavy=("pytorch_lightning", "lightning_fabric")) == ""


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_writes_nothing(lightfleet, tmp_path):
    done = lightfleet("dry_run=true", "strategy=[amp,recompute,gradient_merge]",
                      "strategy.gradient_merge.k_steps=4", "trainer.devices=2")
    assert done.returncode == 0, done.stderr
    assert "precision: plugins.amp:build_precision(dtype='float16'" in done.stdout
    assert "accumulate_grad_batches=4  <- gradient_merge" in done.stdout
    assert "lightning strategy: plugins.ddp:build_ddp()  <- lightfleet" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_typed_strategy_list_over_an_experiment_is_the_plans_whole_selection(lightfleet, tmp_path):
    done = lightfleet("experiment=resnet_amp_recompute", "strategy=[recompute]", "dry_run=true")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "strategies: recompute"
    assert "note: strategy=[recompute] on the command line is the whole selection: the config files' settings for " \
           "amp are dropped (add amp to the list to keep them)\n" in done.stdout
    assert "precision:" not in done.stdout and list(tmp_path.iterdir()) == []


def test_a_knob_of_a_strategy_left_out_of_the_typed_list_is_refused_before_torch(lightfleet):
    command = ("experiment=resnet_amp_recompute", "strategy=[recompute]", "strategy.amp.dtype=float16", "dry_run=true")
    assert_one_line_error(lightfleet(*command), "strategy.amp.dtype: strategy amp is not selected")
    assert decide_in_process(*command, heavy=HEAVY) == ""


@pytest.mark.slow
def test_existing_run_is_not_overwritten(lightfleet, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("precious: true\n")
    assert_one_line_error(lightfleet(f"paths.output_dir={run}"), "paths.output_dir=", "already holds a run")
    assert (run / "config.yaml").read_text() == "precious: true\n"


# One training step of a small model: the cheapest run that still goes the whole way (reserved,
# Hydra's files, config.yaml, a rank that trains and saves).
ONE_STEP = ("trainer.max_steps=1", "data.num_train=64", "data.num_val=64", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "trainer.num_sanity_val_steps=0")
HELD = re.compile(r"lightfleet: error: (?:hydra\.run\.dir|paths\.sweep_dir)='[^']+': is held by another command "
                  r"\(pid (\d+) on (\S+) since [^)]*: lightfleet [^)]*seed=(\d)[^)]*\); choose another directory$")


def race(lightfleet, *commands) -> list:
    """The commands, started together (each in a thread of its own), as they ended."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: lightfleet(*args), commands))


def assert_one_ran(ended, directory: Path, held: bool = True) -> int:
    """Exactly one of two racing commands (seed=1, seed=2) ran; the other was refused in one line,
    naming the winner as the directory's holder (or, with `held=False`, possibly after the winner
    recorded its run: "already holds"). The winner's seed."""
    assert sorted(done.returncode for done in ended) == [0, 2], [done.stderr[-2000:] for done in ended]
    loser = next(done for done in ended if done.returncode == 2)
    winner = 1 + [done.returncode for done in ended].index(0)
    assert_one_line_error(loser)
    holder = HELD.match(loser.stderr.strip())
    if not held and holder is None:
        assert re.search(r"already holds a run; choose another directory$", loser.stderr.strip()), loser.stderr
        return winner
    assert holder and int(holder.group(3)) == winner, loser.stderr
    owner = yaml.safe_load((directory / "owner.yaml").read_text())
    assert (int(holder.group(1)), holder.group(2)) == (owner["pid"], owner["host"])
    return winner


@pytest.mark.slow
def test_two_commands_given_one_run_directory_never_both_run(lightfleet, tmp_path, monkeypatch):
    """Issue 40 item 2: each command pauses between reserving the directory and writing into it
    (LIGHTFLEET_TEST_PAUSE_RESERVED), so a check apart from the write lets both through every time."""
    monkeypatch.setenv("LIGHTFLEET_TEST_PAUSE_RESERVED", "4")
    ended = race(lightfleet, *[(*ONE_STEP, f"seed={seed}", "hydra.run.dir=run") for seed in (1, 2)])
    winner = assert_one_ran(ended, tmp_path / "run")
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == winner
    assert f"seed={winner}" in yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())  # Hydra's, the winner's
    assert not (run / "checkpoints" / "last-v1.ckpt").exists()  # the loser's last.ckpt beside the winner's


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local"])
def test_two_sweeps_given_one_sweep_directory_never_both_run(lightfleet, tmp_path, monkeypatch, launcher):
    monkeypatch.setenv("LIGHTFLEET_TEST_PAUSE_RESERVED", "4")
    ended = race(lightfleet, *[("-m", f"hydra/launcher={launcher}", *ONE_STEP, f"seed={seed}", "paths.sweep_dir=sweep")
                               for seed in (1, 2)])
    winner = assert_one_ran(ended, tmp_path / "sweep")
    assert [p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir() and not p.name.startswith(".")] == ["0"]
    assert yaml.safe_load((tmp_path / "sweep" / "0" / "config.yaml").read_text())["seed"] == winner


@pytest.mark.slow
def test_twenty_pairs_of_commands_racing_for_one_run_directory_never_both_run(lightfleet, tmp_path):
    """Without the pause: as close as two commands started together come."""
    for pair in range(20):
        assert_one_ran(race(lightfleet, *[(*ONE_STEP, f"seed={seed}", f"hydra.run.dir=run{pair}") for seed in (1, 2)]),
                       tmp_path / f"run{pair}", held=False)


def test_multi_node_without_rendezvous_address_is_refused_before_spawning(lightfleet):
    assert_one_line_error(lightfleet("trainer.num_nodes=2"), "trainer.num_nodes=2", "MASTER_ADDR")


def test_help_lists_groups_strategies_and_experiments(lightfleet):
    done = lightfleet("--help")
    assert done.returncode == 0
    assert f"strategy: {', '.join(sorted(strategies.names()))}\n" in done.stdout  # the registry's
    assert {"amp", "recompute", "sharding", "pipeline"} <= set(strategies.names())
    assert "quickstart" in done.stdout


def test_cfg_prints_the_composed_config(lightfleet):
    done = lightfleet("--cfg", "job", "experiment=gpt_recompute_gradient_merge")
    assert done.returncode == 0, done.stderr
    assert "k_steps: 4" in done.stdout and "GPTDecoder" in done.stdout


@pytest.mark.slow
def test_help_answers_without_torch_lightning_or_hydra_and_lists_the_subcommands(tmp_path):
    """In a fresh process: --help imports none of them, and takes a small share of `import torch`."""
    script = ("import sys; from runner.command.cli import main; assert main(['--help']) == 0; "
              "assert not {'torch', 'pytorch_lightning', 'hydra'} & set(sys.modules), sorted(sys.modules)")
    helped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr[-2000:]
    for name in usage.SUBCOMMANDS:
        assert f"\n  {name} " in helped.stdout
    assert "\nstrategy: " in helped.stdout and "quickstart" in helped.stdout
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runner", "--help"], capture_output=True, check=True, cwd=tmp_path)
    help_s = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, pytorch_lightning"], check=True)
    assert help_s < 0.5 * (time.perf_counter() - started)


@pytest.mark.parametrize("command", ["resume", "eval", "replay"])
def test_each_run_dir_subcommand_has_its_help(lightfleet, command):
    done = lightfleet(command, "--help")
    assert done.returncode == 0 and done.stdout.startswith(f"usage: lightfleet {command} RUN_DIR"), done.stderr
    assert ("trainer.devices=M to go on with M processes" in done.stdout) == (command == "resume")


def test_version_names_lightfleets_and_a_misspelt_subcommand_gets_did_you_mean(lightfleet):
    version = lightfleet("--version")
    assert version.returncode == 0 and version.stdout.startswith("lightfleet 0.") and "torch " in version.stdout
    typo = lightfleet("reprot")
    assert typo.returncode == 2 and "did you mean report?" in typo.stderr and len(typo.stderr.splitlines()) == 1
    # A subcommand after a flag and its value: the order that works (Hydra said "Error parsing override").
    late = lightfleet("-cd", "cfg", "rehearse", "trainer.devices=8")
    assert late.returncode == 2 and late.stderr == (
        "lightfleet: error: lightfleet='rehearse': a subcommand comes first: lightfleet rehearse -cd cfg "
        "trainer.devices=8\n")


# --------------------------------------------------------------------------- every documented form of every subcommand


def documented_lines() -> Iterator[str]:
    """Every `lightfleet SUBCOMMAND ...` the user is shown: the command lines and inline code of
    README.md and docs/*.md, and each subcommand's arguments in `lightfleet --help`."""
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for language, block in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
            if language in ("", "bash", "console", "sh"):  # not a yaml or text block's lines
                yield from (line.split("  #")[0].strip().removeprefix("$ ") for line in block.splitlines())
        yield from re.findall(r"`(lightfleet [^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
    yield from (f"lightfleet {name} {arguments}" for name, (arguments, _) in usage.SUBCOMMANDS.items())


def form_of(command: str, words: list) -> str:
    """The shape of a subcommand's arguments: each run of paths PATH, of overrides KEY=VALUE, flags
    as written (without their values)."""
    shape, flag_value = [command], False
    for word in words:
        if flag_value:
            flag_value = False
            continue
        if word.startswith("-"):
            shape.append(word.split("=")[0])
            flag_value = "=" not in word and word not in FLAGS_WITHOUT_VALUE
        elif shape[-1] != (kind := "KEY=VALUE" if "=" in word else "PATH"):
            shape.append(kind)
    return " ".join(shape)


FLAGS_WITHOUT_VALUE = ("--lines",)


def documented_forms() -> dict:
    """Each documented form -> the lines that show it. An optional [part] shows the form with and
    without it; `a|b` two subcommands; `...` (more of the same, or left out) is no argument. The
    subcommand alone is a form only where all its arguments are optional (report); elsewhere it
    names the subcommand in prose."""
    forms: dict = {}
    for line in documented_lines():
        groups = re.findall(r"\[[^\[\]]*\]", line)
        for kept in itertools.product((False, True), repeat=len(groups)):
            variant = line
            for group, keep in zip(groups, kept):
                variant = variant.replace(group, group[1:-1] if keep else "", 1)
            words = [word for word in variant.split() if word != "..."]
            if len(words) < 2 or words[0] != "lightfleet":
                continue
            for command in words[1].split("|"):
                if command in usage.SUBCOMMANDS and (words[2:] or usage.SUBCOMMANDS[command][0].startswith("[")):
                    forms.setdefault(form_of(command, words[2:]), []).append(line)
    return forms


# Each documented form -> the test that runs it and asserts what it does.
FORMS = {
    "eval PATH": "tests/runner/test_cli.py::test_eval_of_a_run_or_of_a_checkpoint_trains_nothing_and_prints_the_metrics",
    "eval PATH KEY=VALUE": "tests/runner/test_cli.py::test_eval_of_a_run_or_of_a_checkpoint_trains_nothing_and_prints_the_metrics",
    "eval KEY=VALUE": "tests/runner/test_cli.py::test_eval_of_a_run_or_of_a_checkpoint_trains_nothing_and_prints_the_metrics",
    "replay PATH": "tests/runner/test_cli.py::test_replay_trains_the_saved_config_again_from_its_start_with_the_overrides",
    "replay PATH KEY=VALUE": "tests/runner/test_cli.py::test_replay_trains_the_saved_config_again_from_its_start_with_the_overrides",
    "resume PATH": "tests/test_hydra_app.py::test_resume_says_where_it_continues_counts_its_own_steps_and_refuses_a_finished_run",
    "resume PATH KEY=VALUE": "tests/test_hydra_app.py::test_resume_continues_the_step_count_and_the_loss_curve",
    "rehearse": "tests/runner/test_rehearse_command.py::test_rehearse_help_and_a_rehearsal_without_overrides",
    "rehearse KEY=VALUE": "tests/runner/test_rehearse_command.py::test_the_whole_command_with_stand_in_ranks_fits_and_does_not_fit",
    "rehearse --config-dir KEY=VALUE": "tests/runner/test_auto_rehearse.py::test_the_winners_best_yaml_reruns",
    "report": "tests/runner/test_report.py::test_no_path_reports_the_newest_sweep_under_multirun",
    "report PATH": "tests/runner/test_cli.py::test_report_of_a_run_directory_through_the_command",
    "report PATH --baseline": "tests/runner/test_report.py::test_a_run_directory_and_several_paths",
    "report PATH --out": "tests/runner/test_report.py::test_a_run_directory_and_several_paths",
    "import-fleet PATH": "tests/runner/test_fleet.py::test_default_output_is_the_file_stem_in_the_current_directory",
    "import-fleet PATH -o": "tests/runner/test_fleet.py::test_import_train_and_export_through_the_command",
    "export-fleet PATH": "tests/runner/test_fleet.py::test_import_train_and_export_through_the_command",
    "export-fleet PATH -o": "tests/runner/test_fleet.py::test_export_writes_fleet_names_and_values",
    "prepare-data PATH --tokenizer -o": "tests/runner/test_prepare_data.py::"
                                        "test_text_files_become_token_files_that_decode_to_the_documents_each_followed_by_end_of_text",
}


def test_every_documented_form_of_every_subcommand_has_a_test_that_runs_it():
    forms = documented_forms()
    assert {"eval KEY=VALUE", "report", "export-fleet PATH -o"} <= set(forms)  # the reading finds them
    assert sorted(forms) == sorted(FORMS), {form: forms.get(form, "not documented") for form in
                                            set(forms) ^ set(FORMS)}
    for form, test in FORMS.items():
        path, name = test.split("::")
        assert f"\ndef {name}(" in (PROJECT_ROOT / path).read_text(), (form, test)


QUIET = ("trainer.enable_progress_bar=false",)


@pytest.fixture(scope="module")
def trained(lightfleet_in, tmp_path_factory) -> Path:
    """A short run of the default model (4 steps, its last.ckpt) that eval, replay and report start from."""
    folder = tmp_path_factory.mktemp("trained")
    done = lightfleet_in(folder, "trainer.max_steps=4", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def ran(done: subprocess.CompletedProcess) -> tuple:
    """The run directory the command says it wrote, and its results."""
    assert done.returncode == 0, done.stderr[-3000:]
    run = Path(re.findall(r"^lightfleet: run directory (.+)$", done.stdout, flags=re.M)[-1])
    return run, yaml.safe_load((run / "results.yaml").read_text())


def evaluated(done: subprocess.CompletedProcess) -> dict:
    run, results = ran(done)
    assert re.search(r"^lightfleet: evaluated: (test_acc [0-9.]+, test_loss [0-9.]+, )?val_acc [0-9.]+, "
                     r"val_loss [0-9.]+; run directory ", done.stdout, flags=re.M), done.stdout[-2000:]
    # Nothing trained: no training loss, the checkpoint's step (Lightning's validate may say 0), no new checkpoint.
    assert "train_loss" not in results and results["global_step"] in (0, 4)
    assert not (run / "checkpoints").exists()
    return results


@pytest.mark.slow
def test_eval_of_a_run_or_of_a_checkpoint_trains_nothing_and_prints_the_metrics(lightfleet, trained):
    of_run = evaluated(lightfleet("eval", str(trained)))
    # A checkpoint without a run directory: the config the overrides compose, evaluate=true.
    of_checkpoint = evaluated(lightfleet("eval", f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}",
                                         "trainer.max_steps=8", "paths.output_dir=of_checkpoint"))
    tested = evaluated(lightfleet("eval", str(trained), "test=true", "paths.output_dir=tested"))
    assert of_checkpoint["val_loss"] == tested["val_loss"] == of_run["val_loss"]  # the same weights, data and config
    assert tested["test_loss"] > 0 and "test_loss" not in of_run


@pytest.mark.slow
def test_a_checkpoint_of_lightnings_own_name_is_taken_as_typed(lightfleet, trained):
    """`epoch=0-step=4.ckpt` holds `=`, which Hydra's override syntax reads only in quotes."""
    (named,) = (trained / "checkpoints").glob("epoch=*-step=*.ckpt")
    run, _ = ran(lightfleet("eval", f"ckpt_path={named}", "paths.output_dir=of_named"))
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] == str(named)


def documented_overrides() -> Iterator[Tuple[str, List[str]]]:
    """(where, overrides) of every `lightfleet ...` line of README.md and docs/ (placeholders, other
    subcommands' arguments and lines with the user's config files aside), and of every callback or
    logger knob written inline (`callbacks.x.y=V`, or without a value: then any value)."""
    for line in set(documented_lines()) - SHOWN_REFUSED:
        if not line.startswith("lightfleet "):  # a line of output
            continue
        words = [word for word in shlex.split(line.rstrip("\\"))[1:] if not re.match(r"\[|\.\.\.", word)]
        if not words or words[0] in usage.SUBCOMMANDS and words[0] not in RUN_DIR_COMMANDS or \
                {"-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name"} & set(words):
            continue
        yield line, [word for word in words if "=" in word and not word.startswith("-")]
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        for key, value in re.findall(r"`(\+?(?:callbacks|logger)\.[\w.]+)(=[^`\s]*)?`", path.read_text()):
            yield path.name, [key + (value or "=null")]


def test_every_knob_the_docs_show_is_written_as_the_command_takes_it():
    """Issue 40 item 7: composed as typed, without a key the config lacks (a knob that needs `+`)
    or Hydra's syntax errors; values are not judged here (they may be placeholders)."""
    from runner.config.compose import compose_config
    from runner.core.errors import ConfigError, Refusal

    missing = []
    for where, overrides in documented_overrides():
        try:
            compose_config(overrides)
        except (ConfigError, Refusal) as refused:
            if re.search(r"has no key|is not selected|mismatched input|extraneous input|token recognition", str(refused)):
                missing.append(f"{where}: {' '.join(overrides)}: {refused}")
    assert not missing, "\n".join(missing)


SHOWN_REFUSED = {"lightfleet 'strategy=[amp]' strategy.amp.init_los_scaling=1"}  # docs/guide.md's "did you mean"
RUN_DIR_COMMANDS = ("resume", "eval", "replay")


@pytest.mark.slow
def test_replay_trains_the_saved_config_again_from_its_start_with_the_overrides(lightfleet, trained):
    first = yaml.safe_load((trained / "results.yaml").read_text())
    run, again = ran(lightfleet("replay", str(trained)))
    assert again["global_step"] == 4 and again["train_loss"] == pytest.approx(first["train_loss"])
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] is None  # from the start
    run, shorter = ran(lightfleet("replay", str(trained), "trainer.max_steps=2", "paths.output_dir=shorter"))
    assert shorter["global_step"] == 2 and yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 2


@pytest.mark.slow
def test_report_of_a_run_directory_through_the_command(lightfleet, trained, tmp_path):
    run = shutil.copytree(trained, tmp_path / "copied")
    done = lightfleet("report", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(run / "report.csv") as table:
        (row,) = list(csv.DictReader(table))
    assert row["job"] == "copied" and float(row["samples_per_s"]) == pytest.approx(
        yaml.safe_load((run / "results.yaml").read_text())["samples_per_s"], rel=1e-3)
    assert (run / "report.md").is_file() and "copied" in done.stdout
