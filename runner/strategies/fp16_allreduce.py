"""fp16_allreduce: half-precision gradient communication (Fleet `strategy.fp16_allreduce`); carried
out by plugins/fp16_allreduce.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

from runner.core.contribution import Component, Contribution, Facts, RunShape, Strategy
from runner.core.errors import require

DTYPES = ("float16", "bfloat16")


@dataclass
class FP16AllreduceConfig(Strategy):
    """Half-precision gradient communication (Fleet: `strategy.fp16_allreduce`): gradients travel
    in 16 bits and are restored to float32 (torch fp16/bf16 compress hooks)."""

    name: ClassVar[str] = "fp16_allreduce"
    changes_numerics: ClassVar[bool] = True

    dtype: str = "float16"
    """Wire type of the gradients: float16 or bfloat16 (wider range, less precision)."""

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "strategy.fp16_allreduce.dtype", self.dtype, f"allowed: {', '.join(DTYPES)}",
                DTYPES)

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.world_size >= 2 else "one process: no gradients to exchange"

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(comm_hook=Component("plugins.fp16_allreduce:build_hook", asdict(self)))
