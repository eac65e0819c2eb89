"""localsgd: local SGD with periodic parameter averaging (Fleet `strategy.localsgd`); carried out by
plugins/localsgd.py. `LocalSGDFamily` is what it shares with adaptive_localsgd."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require


@dataclass
class LocalSGDFamily(Strategy):
    """Local SGD's way of training (localsgd, adaptive_localsgd): gradients averaged every step
    until begin_step (torch's post-local-SGD hook), then each process steps alone and the
    parameters are averaged by the member's own callback."""

    changes_numerics: ClassVar[bool] = True

    begin_step: int = 1
    """Step from which local SGD starts (synchronous data parallelism before)."""

    def __post_init__(self) -> None:
        require(self.begin_step >= 1, f"strategy.{self.name}.begin_step", self.begin_step, "must be >= 1")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.world_size >= 2 else "one process: no gradients to exchange"

    def synchronous_until_begin_step(self) -> Component:
        """The communication hook: DDP's allreduce until begin_step, nothing after."""
        return Component("plugins.localsgd:build_hook", {"begin_step": self.begin_step})

    def averaging_knobs(self) -> dict:
        """The member's knobs for its averaging callback: its own first, begin_step last."""
        knobs = asdict(self)
        begin_step = knobs.pop("begin_step")
        return {**knobs, "begin_step": begin_step}


@dataclass
class LocalSGDConfig(LocalSGDFamily):
    """Local SGD (Fleet: `strategy.localsgd`, `localsgd_configs`; Lin et al. 2018): gradients are
    averaged every step until begin_step, then each process steps alone and the parameters are
    averaged every k_steps (torch post-local-SGD hook + periodic model averager)."""

    name: ClassVar[str] = "localsgd"

    k_steps: int = 1
    """Local steps between two parameter averagings."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.k_steps >= 1, "strategy.localsgd.k_steps", self.k_steps, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(comm_hook=self.synchronous_until_begin_step(),
                            callbacks=[Component("plugins.localsgd:ModelAveraging", self.averaging_knobs())])
