"""lamb: layer-wise adaptive moments (Fleet `strategy.lamb`); carried out by plugins/lamb.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, List, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require


@dataclass
class LambConfig(Strategy):
    """Layer-wise adaptive moments (Fleet: `strategy.lamb`, `lamb_configs`; You et al. 2019).
    Replaces the model's Adam/AdamW optimizer, keeping its learning rate, betas, epsilon and
    schedulers: Adam's update scaled per tensor by the trust ratio ||w|| / ||update||."""

    name: ClassVar[str] = "lamb"
    changes_numerics: ClassVar[bool] = True

    lamb_weight_decay: float = 0.01
    """Decoupled weight decay inside the LAMB update."""
    exclude_from_weight_decay: List[str] = field(default_factory=list)
    """Parameter-name substrings (e.g. bn, bias, norm) whose tensors get no weight decay; as in
    Fleet, they also take Adam-style steps without the trust ratio (see always_adapt)."""
    always_adapt: bool = False
    """Scale by the trust ratio also the tensors without weight decay (Paddle's
    `paddle.optimizer.Lamb(always_adapt=...)`; Fleet's lamb uses False: they take plain Adam-style steps)."""

    def __post_init__(self) -> None:
        require(self.lamb_weight_decay >= 0, "strategy.lamb.lamb_weight_decay", self.lamb_weight_decay, "must be >= 0")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.optimizer == "adam" else f"LAMB replaces Adam or AdamW; the model's optimizer is {facts.optimizer}"

    def fast_path_conflict(self, mechanism: str, run: RunShape) -> Optional[str]:
        return ("replaces the optimizer with LAMB, which torch has no fused kernel for (it steps on foreach kernels)"
                if mechanism == "fused_optimizer" else None)

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.lamb:replace_optimizer", asdict(self)))
