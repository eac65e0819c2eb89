"""Build: turn a validated config and its plan into a Trainer, a model and a datamodule.

The user's LightningModule and DataModule are instantiated by `_target_`; the plan's model
transforms are applied to the model in phase order, and its precision plugin, Lightning
strategy, trainer arguments and callbacks go to the Trainer. The user's code never has to know
which strategies are on.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import pytorch_lightning as pl
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from pytorch_lightning.utilities import rank_zero_info

from runner.config import RunSpec
from runner.errors import ConfigError
from runner.plan import Plan

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


@dataclass
class Built:
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    resolved: Dict[str, Any] = field(default_factory=dict)  # what build decided, for build.yaml


def device_type(accelerator: str) -> str:
    """The torch device type the run uses: CUDA when asked for or (auto) available, else CPU."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def instantiate_checked(key: str, node: DictConfig) -> Any:
    """`hydra.utils.instantiate`, after checking the arguments against the target's signature
    so a typo is one line naming the key instead of a TypeError deep inside the constructor."""
    target = node.get("_target_")
    if not target:
        raise ConfigError(f"{key}._target_", target, "is required: the import path of the class to build")
    module, _, attr = str(target).rpartition(".")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}._target_", target, f"cannot be imported ({error})") from None
    parameters = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        for name in node.keys():
            if name not in HYDRA_KEYS and name not in parameters:
                raise ConfigError.unknown_key(f"{key}.{name}", list(parameters))
    return instantiate(node)


def build(spec: RunSpec, plan: Plan, run_dir: Path) -> Built:
    cfg = spec.cfg
    device = device_type(spec.trainer.accelerator)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = instantiate_checked("model", cfg.model)
    datamodule = instantiate_checked("data", cfg.data)

    resolved: Dict[str, Any] = {"device_type": device, "model_transforms": []}
    for claim in plan.model_transforms:
        changed = claim.component.load()(model, device_type=device, **claim.component.kwargs)
        resolved["model_transforms"].append({"by": claim.by, "phase": claim.phase, "modules": list(changed)})
        rank_zero_info(f"lightfleet: {claim.by} ({claim.phase}) applied to: {', '.join(changed)}")

    trainer_args = asdict(spec.trainer)
    trainer_args.update({arg: claim["value"] for arg, claim in plan.trainer_args.items()})
    plugins: List[Any] = []
    if plan.precision is not None:
        plugins.append(plan.precision.component.load()(device_type=device, **plan.precision.component.kwargs))
    strategy: Any = "auto"
    if plan.lightning_strategy is not None:
        strategy = plan.lightning_strategy.component.load()(**plan.lightning_strategy.component.kwargs)
    callbacks = [instantiate_checked(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node]
    callbacks += [claim.component.load()(**claim.component.kwargs) for claim in plan.callbacks]
    trainer = pl.Trainer(**trainer_args, strategy=strategy, plugins=plugins, callbacks=callbacks,
                         logger=loggers(cfg), default_root_dir=str(run_dir))
    return Built(trainer, model, datamodule, resolved)


def loggers(cfg: DictConfig) -> List[Any]:
    """The configured loggers; one whose package is not installed (TensorBoard) is skipped."""
    built = []
    for name, node in cfg.logger.items():
        if not node:
            continue
        try:
            built.append(instantiate_checked(f"logger.{name}", node))
        except InstantiationException as error:
            if not isinstance(error.__cause__, ModuleNotFoundError):
                raise
            rank_zero_info(f"lightfleet: logger.{name} skipped: {error.__cause__}")
    return built
