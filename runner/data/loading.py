"""The loaders of the built-in data: stateful (torchdata's StatefulDataLoader; a training epoch's
position is the global order's, order.py, which every checkpoint records) and, on a GPU, fed as
a plain training loop feeds one: batches in pinned host memory, which Lightning
copies to the device without blocking (its batch transfer is non-blocking from pinned memory),
and loader workers by default where the data module says `auto`, so that the training process
only hands batches on.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from runner.config.values import check_values

# num_workers=auto on CUDA: at most this many workers per process, leaving the process a core of
# its own (torchvision's and Lightning's examples run 4 to 16 per GPU; in-memory data needs few).
AUTO_WORKERS = 4
Workers = Union[int, str]  # a count, or "auto"


def check_workers(num_workers: Workers) -> None:
    if num_workers != "auto" and not isinstance(num_workers, int):
        raise ValueError(f"num_workers={num_workers}: must be a number >= 0 or auto")
    check_values(num_workers=num_workers)


def on_cuda(trainer: Optional[pl.Trainer]) -> bool:
    """Whether the run trains on a CUDA device (False without a trainer: auto's facts, checks)."""
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


def worker_count(num_workers: Workers, trainer: Optional[pl.Trainer]) -> int:
    """`num_workers`, with auto: none on a CPU (the training uses every core), on CUDA up to
    AUTO_WORKERS, leaving each of the node's processes a core."""
    if num_workers != "auto":
        return int(num_workers)
    if not on_cuda(trainer):
        return 0
    cores_per_process = (os.cpu_count() or 1) // max(1, trainer.num_devices)
    return max(0, min(AUTO_WORKERS, cores_per_process - 1))


def stateful_loader(dataset: Dataset, trainer: Optional[pl.Trainer], *, batch_size: int, num_workers: Workers,
                    pin_memory: bool, prefetch_factor: Optional[int] = None, **options: Any) -> DataLoader:
    """A StatefulDataLoader of `dataset`, pinning batches when `pin_memory` and the run is on CUDA,
    its workers kept across epochs."""
    workers = worker_count(num_workers, trainer)
    kept = {"persistent_workers": True, "prefetch_factor": prefetch_factor} if workers else {}
    return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=workers,
                              pin_memory=pin_memory and on_cuda(trainer), **kept, **options)
