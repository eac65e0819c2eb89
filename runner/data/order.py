"""The order of every training epoch, the same whatever the number of processes: lightfleet's
global order (docs/reliability.md#resume-on-another-number-of-processes).

An epoch is one order of the whole data drawn from (the run's seed, the epoch) alone, cut into
global batches of exactly G samples (G = data-parallel processes x batch size x accumulation);
the last `len % G` samples of the order sit this epoch out. Global batch k is cut into units of
`batch_size` consecutive samples, and unit j goes to data-parallel rank j mod D, in order: each
rank's batches are whole units, and its accumulated micro-batches are the units after one
another. Which samples a global batch holds, and the micro-batches it is made of, depend on G
and the batch size only, never on how many processes share them: a run resumed on another
number of processes trains every global step on the samples it would have. The position in the
epoch is a number of samples of its order, kept by runner/rank/resume.py:GlobalPosition in every
checkpoint (never read back from Lightning's per-rank loop counters).

A user's data module gets the same by one line in its train_dataloader:
`DataLoader(dataset, batch_size=B, sampler=global_order(self.trainer, dataset, B))`.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Sized

import pytorch_lightning as pl
import torch
from torch.utils.data import DistributedSampler
from typing_extensions import override


class GlobalOrder(DistributedSampler):
    """This rank's share of the epoch's global order (the module's rule). A DistributedSampler, so
    that Lightning neither wraps nor replaces it; the epoch is drawn when its first index is (a
    resumed run's iterator is made before Lightning sets the epoch), starting at the resumed
    position in the epoch a run resumed in."""

    def __init__(self, dataset: Sized, *, batch_size: int, seed: int, trainer: Optional[pl.Trainer] = None,
                 shuffle: bool = True) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, drop_last=True, **replicas(trainer))
        self.batch_size = batch_size
        self.global_batch = self.num_replicas * batch_size * (trainer.accumulate_grad_batches if trainer else 1)
        self.position = resumed_position(trainer)
        self.set_epoch(trainer.current_epoch if trainer else 0)  # a run resumed mid-epoch draws before Lightning sets it
        batches = self.order_length() // self.global_batch
        self.total_size = batches * self.global_batch
        self.num_samples = self.total_size // self.num_replicas

    def order_length(self) -> int:
        """How many items one epoch's order holds."""
        return len(self.dataset)

    def epoch_order(self, generator: torch.Generator) -> torch.Tensor:
        """The epoch's order of the whole data, drawn from `generator` (seeded by seed and epoch) alone."""
        size = len(self.dataset)
        return torch.randperm(size, generator=generator) if self.shuffle else torch.arange(size)

    def start(self) -> int:
        """Samples of this epoch's order already trained on: the resumed position in the epoch the
        run resumed in, else 0 (each epoch's number is drawn once in a run)."""
        return self.position.samples_in(self.epoch) if self.position is not None else 0

    @override
    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order(torch.Generator().manual_seed(self.seed + self.epoch))
        units = order[self.start() : self.total_size].view(-1, self.batch_size)
        # A global batch holds G / batch_size units, a multiple of the replicas: unit j of the
        # whole order goes to rank j mod D as unit j of its global batch does.
        yield from units[self.rank :: self.num_replicas].flatten().tolist()

    @override
    def __len__(self) -> int:
        return self.num_samples  # the whole epoch: Lightning counts a resumed epoch's batches from its start


def global_order(trainer: Optional[pl.Trainer], dataset: Sized, batch_size: int, shuffle: bool = True) -> GlobalOrder:
    """The sampler of a user's train_dataloader that makes its data resume on any number of
    processes: `DataLoader(dataset, batch_size=B, sampler=global_order(self.trainer, dataset, B))`."""
    return GlobalOrder(dataset, batch_size=batch_size, seed=run_seed(), trainer=trainer, shuffle=shuffle)


class Position:
    """Where the epoch a run resumed in starts: `samples` of epoch `epoch`'s order were trained on
    (kept by runner/rank/resume.py:GlobalPosition, which holds one as `position`)."""

    def __init__(self) -> None:
        self.epoch: Optional[int] = None
        self.samples = 0

    def samples_in(self, epoch: int) -> int:
        return self.samples if epoch == self.epoch else 0


def resumed_position(trainer: Optional[pl.Trainer]) -> Optional[Position]:
    """The run's Position (its GlobalPosition callback's); None without a trainer (checks, auto's facts)."""
    return next((callback.position for callback in (trainer.callbacks if trainer else [])
                 if isinstance(getattr(callback, "position", None), Position)), None)


def run_seed() -> int:
    """The run's seed, which seed_everything(cfg.seed) leaves in the environment."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def replicas(trainer: Optional[pl.Trainer]) -> dict[str, int]:
    """This rank's share of the data: DistributedSampler's num_replicas and rank (the whole data
    without a trainer: auto's facts, the command's checks, tests)."""
    return (trainer and trainer.distributed_sampler_kwargs) or {"num_replicas": 1, "rank": 0}
