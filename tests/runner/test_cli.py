"""The command's contract for bad input: one line on stderr, exit 2, no traceback, nothing lost,
and no heavy import before the decision."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runner import strategies
from runner.command import usage

HEAVY = ("torch", "pytorch_lightning", "lightning_fabric")


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


def test_dry_run_prints_the_plan_and_writes_nothing(lightfleet, tmp_path):
    done = lightfleet("dry_run=true", "strategy=[amp,recompute,gradient_merge]",
                      "strategy.gradient_merge.k_steps=4", "trainer.devices=2")
    assert done.returncode == 0, done.stderr
    assert "precision: plugins.amp:build_precision(dtype='float16'" in done.stdout
    assert "accumulate_grad_batches=4  <- gradient_merge" in done.stdout
    assert "lightning strategy: plugins.ddp:build_ddp()  <- lightfleet" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_existing_run_is_not_overwritten(lightfleet, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("precious: true\n")
    assert_one_line_error(lightfleet(f"paths.output_dir={run}"), "paths.output_dir=", "already holds a run")
    assert (run / "config.yaml").read_text() == "precious: true\n"


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


def test_version_names_lightfleets_and_a_misspelt_subcommand_gets_did_you_mean(lightfleet):
    version = lightfleet("--version")
    assert version.returncode == 0 and version.stdout.startswith("lightfleet 0.") and "torch " in version.stdout
    typo = lightfleet("reprot")
    assert typo.returncode == 2 and "did you mean report?" in typo.stderr and len(typo.stderr.splitlines()) == 1
