"""The optimizer config group, conf/model/optimizer/ (`model/optimizer=adamw`): each option is a whole
optimizer, the built-in models and the experiments take theirs from it, a saved run replays it, and
the strategies that need an optimizer family say which option gives it."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Tuple

import hydra
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from runner.command import cli, preflight
from runner.config.compose import CONFIG_NAME, SAVED_RUN, compose_config
from runner.core.errors import ConfigError
from runner.core.paths import CONF_DIR, EXPERIMENTS_DIR

OPTIONS = CONF_DIR / "model" / "optimizer"
MOMENTUM_SGD = ("SGD", {"lr": 0.1, "momentum": 0.9})
GPT_ADAMW = ("AdamW", {"lr": 3e-3, "weight_decay": 0.01})
NANOGPT_ADAMW = ("AdamW", {"lr": 6e-4, "betas": (0.9, 0.95), "weight_decay": 0.1})
FLEET_RESNET50_SGD = ("SGD", {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4})
# Each built-in model's and experiment's optimizer as its inline node set it before the group
# existed: torch's class and the arguments it was given (the rest at torch's defaults).
KEPT = {
    "model=mlp": MOMENTUM_SGD, "model=resnet": MOMENTUM_SGD, "model=gpt": GPT_ADAMW,
    "model=vision": FLEET_RESNET50_SGD, "model=causal_lm": NANOGPT_ADAMW,
    "experiment=gpt2_124m": NANOGPT_ADAMW, "experiment=gpt_amp_lamb": GPT_ADAMW,
    "experiment=gpt_pipeline_1f1b": GPT_ADAMW, "experiment=gpt_recompute_gradient_merge": GPT_ADAMW,
    "experiment=gpt_sharding_hybrid": GPT_ADAMW, "experiment=gpt_sharding_stage2": GPT_ADAMW,
    "experiment=mlp_ddp_amp": MOMENTUM_SGD, "experiment=mlp_dgc_recompute": MOMENTUM_SGD,
    "experiment=mlp_localsgd": MOMENTUM_SGD, "experiment=quickstart": MOMENTUM_SGD,
    "experiment=resnet50_fleet_collective": FLEET_RESNET50_SGD, "experiment=resnet_amp_recompute": MOMENTUM_SGD,
    "experiment=resnet_amp_recompute_lars": ("SGD", {"lr": 4.0, "momentum": 0.9}),
}


def built(node: Any) -> torch.optim.Optimizer:
    """The optimizer a composed `model.optimizer` node builds over one parameter."""
    return hydra.utils.instantiate(node, _convert_="all")([torch.nn.Parameter(torch.zeros(2))])


def settings(optimizer: torch.optim.Optimizer) -> Tuple[str, Dict[str, Any]]:
    return type(optimizer).__name__, {key: list(value) if isinstance(value, tuple) else value
                                      for key, value in optimizer.defaults.items()}


def test_every_model_and_experiment_keeps_the_optimizer_it_had():
    assert set(KEPT) == {f"model={path.stem}" for path in (CONF_DIR / "model").glob("*.yaml")} | {
        f"experiment={path.stem}" for path in EXPERIMENTS_DIR.glob("*.yaml")}
    for selection, (name, arguments) in KEPT.items():
        optimizer = built(compose_config([selection]).model.optimizer)
        expected = getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2))], **arguments)
        assert settings(optimizer) == settings(expected), selection


@pytest.mark.parametrize("path", [*(CONF_DIR / "model").glob("*.yaml"), *EXPERIMENTS_DIR.glob("*.yaml")],
                         ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_no_model_or_experiment_writes_an_optimizer_node_of_its_own(path):
    """The class and its knobs come from the group's option: a `_target_` beside them would keep
    knobs of another class when the option changes."""
    text = yaml.safe_load(path.read_text())
    model = text if path.parent.name == "model" else text.get("model", {})
    assert "_target_" not in model.get("optimizer", {})
    assert path.parent.name != "model" or "optimizer" not in model


@pytest.mark.parametrize("option", sorted(path.stem for path in OPTIONS.glob("*.yaml")))
def test_an_option_replaces_the_whole_optimizer(option):
    """`model/optimizer=X` is X alone over every model, none of the knobs of the model's own option
    left, and each of X's knobs reaches the optimizer it builds."""
    alone = OmegaConf.to_container(compose_config([f"model/optimizer={option}"]).model.optimizer)
    for model in ("resnet", "gpt", "causal_lm", "vision"):
        assert OmegaConf.to_container(compose_config([f"model={model}", f"model/optimizer={option}"]).model.optimizer) \
            == alone, model
    name, arguments = settings(built(alone))
    assert f"torch.optim.{name}" == alone["_target_"]
    assert {key: arguments[key] for key in alone if not key.startswith("_")} == {
        key: value for key, value in alone.items() if not key.startswith("_")}


def test_adamw_over_the_default_model_has_no_momentum_left():
    node = compose_config(["model/optimizer=adamw"]).model.optimizer
    assert node._target_ == "torch.optim.AdamW" and "momentum" not in node
    assert isinstance(built(node), torch.optim.AdamW)


def checked(*overrides: str) -> preflight.Flight:
    return preflight.check_job(preflight.compose(list(overrides), None, CONFIG_NAME))


def test_lamb_over_the_default_model_names_the_option_that_gives_it_adam():
    with pytest.raises(ConfigError, match=r"^model\.optimizer='SGD': lamb needs an Adam-family optimizer .*; choose "
                                          r"one with model/optimizer=adam or model/optimizer=adamw$"):
        checked("strategy=[lamb]")
    flight = checked("strategy=[lamb]", "model/optimizer=adamw")
    assert flight.plan.strategies == ["lamb"] and flight.plan.optimizer.component.target == "plugins.lamb:replace_optimizer"


@pytest.mark.parametrize("strategy, devices", [("lars", 1), ("dgc", 2)])
def test_lars_and_dgc_over_adamw_name_the_option_that_gives_momentum_sgd(strategy, devices):
    over = (f"strategy=[{strategy}]", f"trainer.devices={devices}", "model=gpt", "data=language_model")
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='AdamW': {strategy} needs momentum SGD .*; choose it "
                                          r"with model/optimizer=sgd$"):
        checked(*over)
    assert checked(*over, "model/optimizer=sgd").plan.strategies == [strategy]


def test_a_saved_run_of_an_option_replays_it(tmp_path):
    """`lightfleet replay RUN_DIR` composes the config.yaml a run saved: its optimizer as the option made it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = compose_config(["strategy=[lamb]", "model/optimizer=adamw", f"paths.output_dir={run_dir}"])
    OmegaConf.save(saved, run_dir / "config.yaml")
    arguments = cli.from_run_dir("replay", [str(run_dir), "model.optimizer.lr=0.002"])
    assert arguments[:2] == ["-cn", SAVED_RUN]
    flight = preflight.check_job(preflight.compose(arguments[2:], None, SAVED_RUN))
    replayed = OmegaConf.to_container(flight.spec.cfg.model.optimizer)
    assert replayed == {**OmegaConf.to_container(saved.model.optimizer), "lr": 0.002}
    assert flight.plan.strategies == ["lamb"]


def test_help_lists_the_optimizer_options():
    from runner.command.usage import help_text

    options = ", ".join(sorted(path.stem for path in OPTIONS.glob("*.yaml")))
    assert f"\nmodel/optimizer: {options}\n" in help_text()
    assert {"sgd", "adam", "adamw"} <= set(options.split(", "))


@pytest.mark.slow
def test_lamb_over_adamw_trains_the_default_model(lightfleet, tmp_path: Path):
    done = lightfleet("strategy=[lamb]", "model/optimizer=adamw", "trainer.max_steps=30", "paths.output_dir=run",
                      "trainer.enable_progress_bar=false", "callbacks=none")
    assert done.returncode == 0, done.stderr[-3000:]
    results = yaml.safe_load((tmp_path / "run" / "results.yaml").read_text())
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["optimizer"]
    assert saved["_target_"] == "torch.optim.AdamW" and "momentum" not in saved
    # It learns: 4 classes, chance's loss is ln 4 (1.39); LAMB over AdamW's 1e-3 ends near 1.04.
    assert results["global_step"] == 30 and results["train_loss"] < 0.9 * math.log(4)
