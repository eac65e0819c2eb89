"""Build: turn a validated config and its plan into a Trainer, a model and a datamodule.

The user's LightningModule and DataModule are instantiated by `_target_`; the plan's model
transforms run in the model's `configure_model` (plugins/transforms.py), its optimizer
replacement wraps the model's `configure_optimizers`, and its precision plugin, Lightning
strategy (with the communication hook), trainer arguments and callbacks go to the Trainer.
The collective knobs (plugins/collective.py) join in at each of these places.
The user's code never has to know which strategies are on.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
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
from plugins.resume import EpochEndPosition, RandomStates
from plugins.transforms import ModelContext, Transform, apply_transforms, transform_in_configure_model
from runner.config.arguments import check_arguments
from runner.config.checks import RunSpec
from runner.core.errors import ConfigError
from runner.rank.measure import RunMeter
from runner.core.plan import Plan
from runner.rank.preemption import Preemption
from runner.records.run_dir import write_yaml
from runner.config.schema import CollectiveConfig

DDP_TARGET = "plugins.ddp:build_ddp"  # lightfleet's DDP, which takes the collective knobs' DDP arguments
# A scheduler re-pointed by `replace_optimizers` warns that its optimizer's step "has been
# overridden": the replacement is deliberate, and the scheduler still steps after the optimizer.
warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")


@dataclass
class Built:
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    meter: Optional[RunMeter]  # None when measurement is switched off


def device_type(accelerator: str) -> str:
    """The torch device type the run uses: CUDA when asked for or (auto) available, else CPU."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def instantiate_checked(key: str, node: DictConfig) -> Any:
    """`hydra.utils.instantiate`, after checking the arguments against the target's signature
    (runner.config.arguments), so a typo is one line naming the key, not a TypeError in the constructor."""
    check_arguments(key, OmegaConf.to_container(node, resolve=True))
    # Plain lists and dicts, not OmegaConf containers: they reach checkpoints' hyper-parameters,
    # which then load with torch.load(weights_only=True) and without omegaconf.
    return instantiate(node, _convert_="all")


def build(spec: RunSpec, plan: Plan, run_dir: Path) -> Built:
    cfg = spec.cfg
    device = device_type(spec.trainer.accelerator)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = instantiate_checked("model", cfg.model)
    datamodule = instantiate_checked("data", cfg.data)

    collective_config: CollectiveConfig = OmegaConf.to_object(cfg.collective)  # its __post_init__ checks ranges
    uses_ddp = plan.lightning_strategy is not None and plan.lightning_strategy.component.target == DDP_TARGET
    collective_lines = collective.describe(collective_config, uses_ddp, "sharding" in plan.strategies)
    transform_in_configure_model(model, model_transforms(plan),
                                 partial(record_transforms, model, plan, run_dir, collective_lines))

    trainer_args = asdict(spec.trainer)
    trainer_args.update(collective.trainer_args(collective_config, spec.trainer, device))
    trainer_args.update({arg: claim["value"] for arg, claim in plan.trainer_args.items()})
    plugins: List[Any] = []
    if plan.precision is not None:
        plugins.append(plan.precision.component.load()(device_type=device, **plan.precision.component.kwargs))
    if plan.optimizer is not None:
        replace_optimizers(model, partial(plan.optimizer.component.load(), model=model,
                                          **plan.optimizer.component.kwargs))
    apply_collective_to_model(model, collective_config)
    # The plan's callbacks first: the user's then see what the strategies did (summed gradients, averaged parameters).
    callbacks = [claim.component.load()(**claim.component.kwargs) for claim in plan.callbacks]
    callbacks += [instantiate_checked(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node]
    meter = RunMeter(cfg.measure.warmup_steps) if cfg.measure.enabled else None
    callbacks += [meter] if meter else []
    callbacks.append(collective.CollectiveSetup(collective_config))
    callbacks.append(Preemption(run_dir / "checkpoints" / "last.ckpt"))
    callbacks += [RandomStates(), EpochEndPosition()]
    strategy = lightning_strategy(plan, collective.ddp_kwargs(collective_config) if uses_ddp else None)
    collective.set_timeout(strategy, collective_config)
    trainer = pl.Trainer(**trainer_args, strategy=strategy, plugins=plugins, callbacks=callbacks,
                         logger=loggers(cfg), default_root_dir=str(run_dir))
    return Built(trainer, model, datamodule, meter)


def lightning_strategy(plan: Plan, ddp_kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """The plan's Lightning strategy, given its communication hook and (lightfleet's DDP) the
    collective knobs' DDP arguments; "auto" (Lightning's choice) if none."""
    if plan.lightning_strategy is None:
        return "auto"
    kwargs = {**plan.lightning_strategy.component.kwargs, **(ddp_kwargs or {})}
    if plan.comm_hook is not None:
        kwargs["comm_hook"] = partial(plan.comm_hook.component.load(), **plan.comm_hook.component.kwargs)
    return plan.lightning_strategy.component.load()(**kwargs)


def apply_collective_to_model(model: pl.LightningModule, config: CollectiveConfig) -> None:
    """torch.compile (op fusion) in `configure_model` after the plan's transforms, so it compiles
    the model they changed; foreach optimizers (optimizer fusion) after the plan's replacement."""
    if collective.compiles(config):
        transform_in_configure_model(model, [(collective.compile_model, {})])
    if config.build_strategy.fuse_all_optimizer_ops:
        replace_optimizers(model, collective.use_foreach)


def check_plan_on_model(model: pl.LightningModule, plan: Plan) -> None:
    """What only the built model can refuse, checked in the command before any directory or rank:
    the plan's model transforms (recompute's and amp's module names, pipeline split names) and its
    optimizer replacement (the optimizer family lars, lamb and dgc need), on `model` built on the
    meta device. A ConfigError stops the command; anything else needs a rank (a process group, a
    trainer, dgc's hook state), and the ranks check it again, fully."""

    def transforms() -> None:
        apply_transforms(ModelContext(model), model_transforms(plan))

    def optimizer() -> None:
        if plan.optimizer is not None:
            replace_optimizers(model, partial(plan.optimizer.component.load(), model=model,
                                              **plan.optimizer.component.kwargs))
            model.configure_optimizers()

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
        write_yaml(run_dir / "build.yaml", resolved)


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
