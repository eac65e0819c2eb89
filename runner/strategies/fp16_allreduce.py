"""fp16_allreduce: half-precision gradient communication (Fleet `strategy.fp16_allreduce`); carried
out by plugins/fp16_allreduce.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from runner.contribution import Component, Contribution, RunShape, Strategy
from runner.errors import require

DTYPES = ("float16", "bfloat16")


@dataclass
class FP16AllreduceConfig(Strategy):
    """Half-precision gradient communication (Fleet: `strategy.fp16_allreduce`): gradients travel
    in 16 bits and are restored to float32 (torch fp16/bf16 compress hooks)."""

    name: ClassVar[str] = "fp16_allreduce"

    dtype: str = "float16"
    """Wire type of the gradients: float16 or bfloat16 (wider range, less precision)."""

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "strategy.fp16_allreduce.dtype", self.dtype, f"allowed: {', '.join(DTYPES)}",
                DTYPES)

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(comm_hook=Component("plugins.fp16_allreduce:build_hook", asdict(self)))
