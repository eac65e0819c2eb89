"""gradient_merge: gradient accumulation (Fleet `strategy.gradient_merge`); carried out by Lightning
and plugins/gradient_merge.py."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional

from runner.core.contribution import Component, Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import require


@dataclass
class GradientMergeConfig(Strategy):
    """Gradient accumulation (Fleet: `strategy.gradient_merge`, `strategy.gradient_merge_configs`)."""

    name: ClassVar[str] = "gradient_merge"
    for_memory_only: ClassVar[bool] = True  # auto splits the batch into k micro-batches of batch / k

    k_steps: int = 1
    """Micro-steps per optimizer update (Lightning `accumulate_grad_batches`)."""
    avg: bool = True
    """Average the k micro-step gradients (true) or sum them (false)."""

    def __post_init__(self) -> None:
        require(self.k_steps >= 1, "strategy.gradient_merge.k_steps", self.k_steps, "must be >= 1")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if (facts.batch_size or 0) >= 2 else "the data has no batch_size of 2 or more to split"

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        return replace(memory, micro_batch_fraction=memory.micro_batch_fraction / self.k_steps)  # micro-batches of batch / k

    def speed(self, facts: Facts) -> float:
        return 0.95  # smaller micro-batches use the device less well

    def variants(self, facts: Facts) -> List[Dict[str, Any]]:
        return [{"k_steps": k} for k in (2, 4) if (facts.batch_size or 0) % k == 0]

    def contribute(self, run: RunShape) -> Contribution:
        contribution = Contribution(trainer_args={"accumulate_grad_batches": self.k_steps})
        if not self.avg:
            contribution.callbacks.append(Component("plugins.gradient_merge:GradientSum", {"k_steps": self.k_steps}))
        if self.k_steps == 1:
            contribution.notes.append("gradient_merge.k_steps=1: every micro-step updates (no merging)")
        return contribution
