"""lars: layer-wise adaptive rate scaling (Fleet `strategy.lars`); carried out by plugins/lars.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, List, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require


@dataclass
class LarsConfig(Strategy):
    """Layer-wise adaptive rate scaling (Fleet: `strategy.lars`, `lars_configs`; You et al. 2017).
    Replaces the model's momentum-SGD optimizer, keeping its learning rate, momentum and
    schedulers: local_lr = lr * lars_coeff * ||w|| / (||g|| + lars_weight_decay * ||w|| + epsilon)."""

    name: ClassVar[str] = "lars"
    changes_numerics: ClassVar[bool] = True

    lars_coeff: float = 0.001
    """Trust coefficient: how far one step may move a tensor relative to its norm."""
    lars_weight_decay: float = 0.0005
    """Weight decay inside the LARS update (replaces the base optimizer's)."""
    epsilon: float = 0.0
    """Added to the denominator of the local learning rate."""
    exclude_from_weight_decay: List[str] = field(default_factory=list)
    """Parameter-name substrings (e.g. bn, bias) whose tensors get no weight decay."""

    def __post_init__(self) -> None:
        require(self.lars_coeff > 0, "strategy.lars.lars_coeff", self.lars_coeff, "must be > 0")
        require(self.lars_weight_decay >= 0, "strategy.lars.lars_weight_decay", self.lars_weight_decay, "must be >= 0")
        require(self.epsilon >= 0, "strategy.lars.epsilon", self.epsilon, "must be >= 0")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.optimizer == "sgd_momentum" else f"LARS replaces momentum SGD; the model's optimizer is {facts.optimizer}"

    def fast_path_conflict(self, mechanism: str, run: RunShape) -> Optional[str]:
        return ("replaces the optimizer with LARS, which torch has no fused kernel for (it steps on foreach kernels)"
                if mechanism == "fused_optimizer" else None)

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.lars:replace_optimizer", asdict(self)))
