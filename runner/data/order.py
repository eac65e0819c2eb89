"""The order of every training epoch of the built-in data: drawn from (the run's seed, the epoch)
alone, split over the data-parallel ranks, ordered when its first index is drawn (so that a run
resumed mid-epoch continues with the batch it would have drawn next).
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import pytorch_lightning as pl
from torch.utils.data import DistributedSampler
from typing_extensions import override


class EpochAtFirstDraw(DistributedSampler):
    """A DistributedSampler that orders an epoch when its first index is drawn, not when its
    iterator is made: Lightning makes a resumed run's iterator before it sets the epoch."""

    @override
    def __iter__(self) -> Iterator[int]:
        yield from super().__iter__()


def run_seed() -> int:
    """The run's seed, which seed_everything(cfg.seed) leaves in the environment."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def replicas(trainer: Optional[pl.Trainer]) -> dict[str, int]:
    """This rank's share of the data: DistributedSampler's num_replicas and rank (the whole data
    without a trainer: auto's facts, the command's checks, tests)."""
    return (trainer and trainer.distributed_sampler_kwargs) or {"num_replicas": 1, "rank": 0}
