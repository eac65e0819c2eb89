"""Build: optimizer replacement in every form `configure_optimizers` may return; build carries out
the plan and adds nothing it does not name."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from plugins.collective import CollectiveSetup
from runner.rank.resume import GlobalPosition, RandomStates
from plugins.transforms import transform_in_configure_model
from runner.command.planning import plan_for
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier
from runner.rank.build import build, replace_optimizers
from runner.rank.measure import RunMeter
from runner.rank.preemption import Preemption


def replaced_by_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return torch.optim.Adam([dict(group) for group in optimizer.param_groups])


def returns(kind: str):
    def configure(self):
        sgd = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        step = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.1)
        return {"single": lambda: sgd,
                "list": lambda: [sgd],
                "pair": lambda: ([sgd], [step]),
                "dict": lambda: {"optimizer": sgd, "lr_scheduler": {"scheduler": step, "interval": "step"}}}[kind]()
    return configure


@pytest.mark.parametrize("kind", ["single", "list", "pair", "dict"])
def test_every_optimizer_is_replaced_and_schedulers_follow(kind, monkeypatch):
    monkeypatch.setattr(MLPClassifier, "configure_optimizers", returns(kind))
    model = MLPClassifier()
    replace_optimizers(model, replaced_by_adam)
    result = model.configure_optimizers()
    flat = {"single": lambda r: (r, None), "list": lambda r: (r[0], None), "pair": lambda r: (r[0][0], r[1][0]),
            "dict": lambda r: (r["optimizer"], r["lr_scheduler"]["scheduler"])}[kind](result)
    optimizer, scheduler = flat
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["lr"] == 0.5
    if scheduler is not None:
        assert scheduler.optimizer is optimizer
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


LIGHTFLEETS_CALLBACKS = {CollectiveSetup, RunMeter, Preemption, RandomStates, GlobalPosition}
COLLECTIVE = ["trainer.accelerator=cpu", "trainer.devices=2", "collective.timeout_s=30", "collective.fuse_grad_size_in_MB=8",
              "collective.build_strategy.fuse_all_optimizer_ops=true", "collective.execution_strategy.num_threads=2"]


def test_build_applies_what_the_plan_names_and_nothing_else(spec_for, tmp_path):
    spec = spec_for(*COLLECTIVE, f"paths.output_dir={tmp_path}", "logger=none")
    plan = plan_for(spec)
    built = build(spec.cfg, plan, tmp_path)
    assert LIGHTFLEETS_CALLBACKS <= {type(callback) for callback in built.trainer.callbacks}
    assert built.meter in built.trainer.callbacks
    strategy = built.trainer.strategy
    assert (strategy._timeout, strategy._ddp_kwargs["bucket_cap_mb"]) == (timedelta(seconds=30), 8.0)
    assert built.model.configure_optimizers().param_groups[0]["foreach"] is True

    bare = dataclasses.replace(plan, callbacks=[], optimizer_transforms=[], lightning_strategy_args={})
    built = build(spec.cfg, bare, tmp_path)
    assert not LIGHTFLEETS_CALLBACKS & {type(callback) for callback in built.trainer.callbacks}
    assert built.meter is None
    strategy = built.trainer.strategy
    assert strategy._timeout != timedelta(seconds=30) and "bucket_cap_mb" not in strategy._ddp_kwargs
    assert not built.model.configure_optimizers().param_groups[0]["foreach"]


class LateLayers(MLPClassifier):
    """A user's model that makes a layer in its own configure_model (Lightning's hook for that)."""

    def configure_model(self):
        if not hasattr(self, "late"):
            self.late = nn.Linear(4, 4)


def test_the_plans_transforms_see_what_the_models_own_configure_model_made(tmp_path):
    seen = []

    def record(module, context):
        seen.append(hasattr(module, "late"))
        return []

    model = LateLayers()
    transform_in_configure_model(model, [(record, {})])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(model, SyntheticClassificationData())
    assert seen == [True]  # once, after the model's own
