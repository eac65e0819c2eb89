"""dgc: deep gradient compression (Fleet `strategy.dgc`); carried out by plugins/dgc.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, List, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require


@dataclass
class DGCConfig(Strategy):
    """Deep gradient compression (Fleet: `strategy.dgc`, `dgc_configs`; Lin et al. 2017): only the
    largest accumulated gradients travel (values + indices), the rest accumulate locally, with
    momentum correction; replaces the model's momentum SGD by plain SGD (momentum moves into the
    communication hook)."""

    name: ClassVar[str] = "dgc"
    changes_numerics: ClassVar[bool] = True

    rampup_begin_step: int = 0
    """Step from which gradients are compressed (dense allreduce before)."""
    rampup_step: int = 1
    """Steps over which the sparsity list is walked."""
    sparsity: List[float] = field(default_factory=lambda: [0.999])
    """Fractions of gradient entries NOT sent, in warm-up order; the last one stays."""

    def __post_init__(self) -> None:
        require(self.rampup_begin_step >= 0, "strategy.dgc.rampup_begin_step", self.rampup_begin_step, "must be >= 0")
        require(self.rampup_step >= 1, "strategy.dgc.rampup_step", self.rampup_step, "must be >= 1")
        require(bool(self.sparsity) and all(0 <= s < 1 for s in self.sparsity), "strategy.dgc.sparsity",
                list(self.sparsity), "a non-empty list of values in [0, 1)")

    def applies(self, facts: Facts) -> Optional[str]:
        if facts.world_size < 2:
            return "one process: no gradients to exchange"
        return None if facts.optimizer == "sgd_momentum" else f"DGC corrects momentum SGD; the model's optimizer is {facts.optimizer}"

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.dgc:replace_optimizer", {}),
                            comm_hook=Component("plugins.dgc:build_hook", asdict(self)),
                            callbacks=[Component("plugins.dgc:DGCCheckpoint", {})])
