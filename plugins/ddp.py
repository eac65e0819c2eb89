"""Data parallelism across processes: Lightning's DDPStrategy, with the process-group backend left
to Lightning, which picks it from the environment (nccl on CUDA, gloo on CPU)."""
from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy


def build_ddp() -> DDPStrategy:
    return DDPStrategy()
