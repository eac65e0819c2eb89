"""Gradient merge (Fleet `strategy.gradient_merge`) as Lightning gradient accumulation.

The plan sets `accumulate_grad_batches=k_steps`; Lightning then divides every micro-step's
loss by k, so the merged gradient is the average of the k micro-batch gradients (Fleet's
`avg=true`). `GradientSum` turns it into their sum (`avg=false`).
"""
from __future__ import annotations

from typing import Any, Dict

import pytorch_lightning as pl
import torch
from typing_extensions import override


class GradientSum(pl.Callback):
    """Multiply the accumulated gradients by k_steps right before each optimizer step.

    Lightning has already divided each micro-step's loss by k_steps (also for a shorter last
    window at the end of an epoch), so this undoes exactly that division. The hook runs after
    AMP unscaling and before gradient clipping, so clipping sees the summed gradient.

    The sum is k_steps times the global batch's mean gradient, and a run resumed on another
    number of processes keeps its global batch with another k_steps (issue 41): the factor is
    kept in the checkpoint, and a resumed run goes on with the factor its run started with, so
    that every step makes the update the uninterrupted run made.
    """

    def __init__(self, k_steps: int) -> None:
        self.k_steps = k_steps
        self.factor = k_steps  # the run's first k_steps, from the checkpoint once resumed

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"factor": self.factor}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.factor = state_dict["factor"]

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        grads = [param.grad for group in optimizer.param_groups for param in group["params"]
                 if param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.factor)
