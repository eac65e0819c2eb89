"""gradient_merge: gradient accumulation (Fleet `strategy.gradient_merge`); carried out by Lightning
and plugins/gradient_merge.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runner.contribution import Component, Contribution, RunShape, Strategy
from runner.errors import require


@dataclass
class GradientMergeConfig(Strategy):
    """Gradient accumulation (Fleet: `strategy.gradient_merge`, `strategy.gradient_merge_configs`)."""

    name: ClassVar[str] = "gradient_merge"

    k_steps: int = 1
    """Micro-steps per optimizer update (Lightning `accumulate_grad_batches`)."""
    avg: bool = True
    """Average the k micro-step gradients (true) or sum them (false)."""

    def __post_init__(self) -> None:
        require(self.k_steps >= 1, "strategy.gradient_merge.k_steps", self.k_steps, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        contribution = Contribution(trainer_args={"accumulate_grad_batches": self.k_steps})
        if not self.avg:
            contribution.callbacks.append(Component("plugins.gradient_merge:GradientSum", {"k_steps": self.k_steps}))
        if self.k_steps == 1:
            contribution.notes.append("gradient_merge.k_steps=1: every micro-step updates (no merging)")
        return contribution
