"""adaptive_localsgd: local SGD whose averaging period follows the loss (Fleet
`strategy.adaptive_localsgd`); carried out by plugins/localsgd.py and plugins/adaptive_localsgd.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require


@dataclass
class AdaptiveLocalSGDConfig(Strategy):
    """Adaptive local SGD (Fleet: `strategy.adaptive_localsgd`; Wang & Joshi 2018): local SGD
    whose averaging period follows the loss, k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))
    clipped to [1, 16]; the current k is logged as `localsgd_k`."""

    name: ClassVar[str] = "adaptive_localsgd"
    changes_numerics: ClassVar[bool] = True

    init_k_steps: int = 1
    """Averaging period at begin_step, the reference the adapted period scales."""
    begin_step: int = 1
    """Step from which local SGD starts (synchronous data parallelism before)."""

    def __post_init__(self) -> None:
        require(self.init_k_steps >= 1, "strategy.adaptive_localsgd.init_k_steps", self.init_k_steps, "must be >= 1")
        require(self.begin_step >= 1, "strategy.adaptive_localsgd.begin_step", self.begin_step, "must be >= 1")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.world_size >= 2 else "one process: no gradients to exchange"

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(
            comm_hook=Component("plugins.localsgd:build_hook", {"begin_step": self.begin_step}),
            callbacks=[Component("plugins.adaptive_localsgd:AdaptiveModelAveraging", asdict(self))])
