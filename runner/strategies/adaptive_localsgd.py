"""adaptive_localsgd: local SGD whose averaging period follows the loss (Fleet
`strategy.adaptive_localsgd`); carried out by plugins/localsgd.py and plugins/adaptive_localsgd.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runner.core.contribution import Component, Contribution, RunShape
from runner.core.errors import require
from runner.strategies.localsgd import LocalSGDFamily


@dataclass
class AdaptiveLocalSGDConfig(LocalSGDFamily):
    """Adaptive local SGD (Fleet: `strategy.adaptive_localsgd`; Wang & Joshi 2018): local SGD
    whose averaging period follows the loss, k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))
    clipped to [1, 16]; the current k is logged as `localsgd_k`."""

    name: ClassVar[str] = "adaptive_localsgd"

    init_k_steps: int = 1
    """Averaging period at begin_step, the reference the adapted period scales."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.init_k_steps >= 1, "strategy.adaptive_localsgd.init_k_steps", self.init_k_steps, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(comm_hook=self.synchronous_until_begin_step(),
                            callbacks=[Component("plugins.adaptive_localsgd:AdaptiveModelAveraging",
                                                 self.averaging_knobs())])
