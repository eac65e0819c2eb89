"""Build: carry out a validated config's plan, into a Trainer, a model and a datamodule.

The user's LightningModule and DataModule are instantiated by `_target_`; the plan's model
transforms run in the model's `configure_model` (plugins/transforms.py), its optimizer
replacement and optimizer transforms wrap the model's `configure_optimizers`, and its precision
plugin, Lightning strategy (with its arguments and the communication hook), trainer arguments
and callbacks go to the Trainer, with the config's own trainer arguments, callbacks and loggers.
Nothing else: what changes how the model trains or communicates is in the plan (runner/core/plan.py).
The user's code never has to know which strategies are on.
"""
from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytorch_lightning as pl
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.utilities import rank_zero_info
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from plugins import collective
from plugins.rehearsal import on_meta_while_fake
from plugins.transforms import ModelContext, Transform, apply_transforms, transform_in_configure_model
from runner.config.arguments import check_arguments
from runner.core import world
from runner.core.errors import ConfigError, first_line
from runner.config.collective import LIGHTFLEET_DDP
from runner.config.schema import LIGHTFLEET_TRAINER_KNOBS
from runner.core.plan import AFTER_USER, Claim, Plan
from runner.rank.measure import RunMeter
from runner.records.files import BUILD_YAML
from runner.records.run_dir import write_yaml

# A scheduler re-pointed by `replace_optimizers` warns that its optimizer's step "has been
# overridden": the replacement is deliberate, and the scheduler still steps after the optimizer.
warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")


@dataclass
class Built:
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    meter: Optional[RunMeter]  # the plan's, None when measurement is switched off


def device_type(accelerator: str) -> str:
    """The torch device type the run uses (runner.core.world.device_type, on this machine's CUDA)."""
    return world.device_type(accelerator, torch.cuda.is_available)


def instantiate_checked(key: str, node: DictConfig) -> Any:
    """`hydra.utils.instantiate`, after checking the arguments against the target's signature
    (runner.config.arguments), so a typo is one line naming the key, not a TypeError in the constructor."""
    check_arguments(key, OmegaConf.to_container(node, resolve=True))
    # Plain lists and dicts, not OmegaConf containers: they reach checkpoints' hyper-parameters,
    # which then load with torch.load(weights_only=True) and without omegaconf.
    return instantiate(node, _convert_="all")


def build(cfg: DictConfig, plan: Plan, run_dir: Path) -> Built:
    """`cfg`: the run's config as the command checked and saved it (config.yaml); nothing is checked again."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    with on_meta_while_fake():  # a rehearsal's model: its parameters made later, fake (plugins/rehearsal.py)
        model = instantiate_checked("model", cfg.model)
    datamodule = instantiate_checked("data", cfg.data)

    # What carries out each collective knob, for build.yaml (the plan holds what it applies).
    uses_ddp = plan.lightning_strategy is not None and plan.lightning_strategy.component.target == LIGHTFLEET_DDP.target
    collective_lines = collective.describe(OmegaConf.to_object(cfg.collective), uses_ddp, "sharding" in plan.strategies)
    transform_in_configure_model(model, model_transforms(plan),
                                 partial(record_transforms, model, plan, run_dir, collective_lines))
    if plan.optimizer is not None:
        replace_optimizers(model, optimizer_replacement(plan, model))
    for claim in plan.optimizer_transforms:  # after the replacement: they change the optimizer it made
        replace_optimizers(model, partial(claim.component.load(), **claim.component.kwargs))
    trainer_args = {**{arg: value for arg, value in OmegaConf.to_container(cfg.trainer, resolve=True).items()
                       if arg not in LIGHTFLEET_TRAINER_KNOBS},
                    **{arg: claim["value"] for arg, claim in plan.trainer_args.items()}}
    counted_in_steps(trainer_args)
    plugins: List[Any] = []
    if plan.precision is not None:
        precision = plan.precision.component
        plugins.append(precision.load()(device_type=device_type(cfg.trainer.accelerator), **precision.kwargs))
    if plan.checkpoint_io is not None:
        plugins.append(load(plan.checkpoint_io))
    # The config's callbacks go between the strategies' and lightfleet's own (runner/core/plan.py says why).
    callbacks = [load(claim) for claim in plan.callbacks if claim.phase != AFTER_USER]
    callbacks += [instantiate_checked(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node]
    callbacks += [load(claim) for claim in plan.callbacks if claim.phase == AFTER_USER]
    trainer = pl.Trainer(**trainer_args, strategy=lightning_strategy(plan), plugins=plugins, callbacks=callbacks,
                         logger=loggers(cfg), default_root_dir=str(run_dir))
    meter = next((callback for callback in callbacks if isinstance(callback, RunMeter)), None)
    return Built(trainer, model, datamodule, meter)


STEP_COUNTS = ("val_check_interval", "limit_train_batches")  # counts of optimizer steps in lightfleet's config


def counted_in_steps(trainer_args: Dict[str, Any]) -> None:
    """lightfleet counts trainer.val_check_interval and trainer.limit_train_batches in optimizer
    steps, which keep their meaning when a resume on another number of processes changes the
    accumulation; Lightning counts batches: a count is multiplied by the accumulation (a fraction
    of the epoch stays as it is)."""
    accumulation = trainer_args.get("accumulate_grad_batches", 1)
    for name in STEP_COUNTS:
        count = trainer_args.get(name)
        if isinstance(count, int) and not isinstance(count, bool):
            trainer_args[name] = count * accumulation


def load(claim: Claim) -> Any:
    """What a claim's component makes when called with its keyword arguments."""
    return claim.component.load()(**claim.component.kwargs)


def lightning_strategy(plan: Plan) -> Any:
    """The plan's Lightning strategy, given its arguments and communication hook; "auto"
    (Lightning's choice) if none."""
    if plan.lightning_strategy is None:
        return "auto"
    kwargs = {**plan.lightning_strategy.component.kwargs,
              **{arg: claim["value"] for arg, claim in plan.lightning_strategy_args.items()}}
    if plan.comm_hook is not None:
        kwargs["comm_hook"] = partial(plan.comm_hook.component.load(), **plan.comm_hook.component.kwargs)
    return plan.lightning_strategy.component.load()(**kwargs)


def optimizer_replacement(plan: Plan, model: pl.LightningModule) -> Callable[[Optimizer], Optimizer]:
    """The plan's optimizer replacement, for `replace_optimizers`."""
    return partial(plan.optimizer.component.load(), model=model, **plan.optimizer.component.kwargs)


def check_plan_on_model(model: pl.LightningModule, plan: Plan) -> None:
    """What only the built model can refuse, checked in the command before any directory or rank:
    the plan's model transforms (recompute's and amp's module names, pipeline split names), its
    optimizer replacement (the optimizer family lars, lamb and dgc need) and the model's own
    optimizer's arguments (a negative learning rate), on `model` built on the meta device. A ConfigError stops the command; anything else needs a rank (a process group, a
    trainer, dgc's hook state), and the ranks check it again, fully."""

    def transforms() -> None:
        apply_transforms(ModelContext(model), model_transforms(plan))

    def optimizer() -> None:
        if plan.optimizer is not None:
            replace_optimizers(model, optimizer_replacement(plan, model))
        try:
            model.configure_optimizers()
        except Exception as error:
            if any(f"{os.sep}torch{os.sep}optim{os.sep}" in frame.filename
                   for frame in traceback.extract_tb(error.__traceback__)):  # a torch optimizer refused its arguments
                raise ConfigError("model", None, f"its optimizer refused its arguments: {first_line(error)}") from None
            raise

    for check in (transforms, optimizer):
        try:
            check()
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 (needs a rank: the ranks check it)
            pass


def model_transforms(plan: Plan) -> List[Transform]:
    """The plan's model transforms, in phase order, as plugins/transforms.py applies them."""
    return [(claim.component.load(), claim.component.kwargs) for claim in plan.model_transforms]


def record_transforms(model: pl.LightningModule, plan: Plan, run_dir: Path, collective_lines: List[str],
                      changed: List[List[str]]) -> None:
    """Say what each model transform changed and what the collective knobs do, and write it with
    the device into build.yaml (rank 0)."""
    resolved = {"device_type": model.trainer.strategy.root_device.type, "model_transforms": [],
                "collective": collective_lines}
    for line in collective_lines:
        rank_zero_info(f"lightfleet: {line}")
    for claim, names in zip(plan.model_transforms, changed, strict=True):
        resolved["model_transforms"].append({"by": claim.by, "phase": claim.phase, "modules": names})
        rank_zero_info(f"lightfleet: {claim.by} ({claim.phase}) applied to: {', '.join(names)}")
    if model.trainer.is_global_zero:
        write_yaml(run_dir / BUILD_YAML, resolved)


def replace_optimizers(model: pl.LightningModule, replace: Callable[[Optimizer], Optimizer]) -> None:
    """Make the model's `configure_optimizers` hand out `replace(optimizer)` for every optimizer it
    returns, in any of Lightning's return forms, with LR schedulers re-pointed to the replacement.

    The model's own code (learning rate, momentum, betas, schedulers) stays the source of truth;
    the replacement (LARS, LAMB, DGC's SGD) takes its settings from the optimizer it replaces.
    """
    configure = model.configure_optimizers
    replaced: Dict[int, Optimizer] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, Optimizer):
            if id(value) not in replaced:
                replaced[id(value)] = replace(value)
            return replaced[id(value)]
        if isinstance(value, (LRScheduler, ReduceLROnPlateau)):
            value.optimizer = swap(value.optimizer)
            return value
        if isinstance(value, dict):
            return {key: swap(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(swap(item) for item in value)
        return value

    model.configure_optimizers = lambda: swap(configure())


def loggers(cfg: DictConfig) -> List[Any]:
    """The configured loggers. One whose package is not installed is bad input, never skipped:
    Lightning's message names the package and how to install it."""
    built = []
    for name, node in cfg.logger.items():
        if not node:
            continue
        try:
            built.append(instantiate_checked(f"logger.{name}", node))
        except InstantiationException as error:
            if not isinstance(error.__cause__, ImportError):
                raise
            raise ConfigError(f"logger.{name}", None, f"its package is not installed: {error.__cause__}") from None
    return built
