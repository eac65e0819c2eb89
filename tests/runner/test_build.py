"""Build: optimizer replacement in every form `configure_optimizers` may return."""
from __future__ import annotations

import pytest
import torch

from runner.rank.build import replace_optimizers
from runner.models import MLPClassifier


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
