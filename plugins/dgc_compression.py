"""Deep gradient compression's arithmetic: the warm-up sparsity schedule, how many entries of a
parameter are sent (top-k), the positions of those entries, and the message size that follows.

Kept apart from the hook, whose numbers they are, so that tests and benchmarks can check what
reaches the collective against `message_bytes` without running DDP. Details:
docs/strategies.md#dgc
"""
import math
from typing import Optional, Sequence

import torch


def sparsity_at(step: int, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float]) -> Optional[float]:
    """The sparsity DGC uses at optimizer step `step` (0-based), or None before
    `rampup_begin_step` (dense allreduce). Paddle's `get_period_sparcity`."""
    if step < rampup_begin_step:
        return None
    index = (step - rampup_begin_step) * len(sparsity) // rampup_step
    return float(sparsity[min(len(sparsity) - 1, index)])


def top_k(numel: int, sparsity: float) -> int:
    """How many of `numel` entries are sent at `sparsity`: ceil(numel * (1 - sparsity)), at least 1."""
    # Rounded first so that float error (1 - 0.999 = 0.0010000000000000009) cannot add one.
    return min(numel, max(1, math.ceil(round(numel * (1.0 - sparsity), 6))))


def index_dtype(numel: int) -> torch.dtype:
    """The type of the positions sent for a bucket of `numel` entries: int32 unless it is too small."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def message_bytes(sizes: Sequence[int], sparsity: float, value_bytes: int = 4) -> int:
    """Bytes one rank sends for a bucket of parameters of `sizes` entries: per parameter its top-k
    values plus as many indices (int32 unless the bucket needs int64 positions)."""
    k = sum(top_k(size, sparsity) for size in sizes)
    return k * (value_bytes + index_dtype(sum(sizes)).itemsize)


def select(accumulated: torch.Tensor, sizes: Sequence[int], sparsity: float) -> torch.Tensor:
    """Positions in the bucket of the top-k |accumulated| entries of each parameter (one `topk` per
    parameter, whose entries lie at consecutive offsets)."""
    magnitude = accumulated.abs()
    picked, offset = [], 0
    for size in sizes:
        top = magnitude.narrow(0, offset, size).topk(top_k(size, sparsity), sorted=False).indices
        picked.append(top.add_(offset))
        offset += size
    return torch.cat(picked)
