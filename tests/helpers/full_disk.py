"""A real full disk for the checkpoint tests (tests/test_checkpoints.py): a small tmpfs mounted
for the test (`small_filesystem`), and `FillDisk`, a callback a run loads by name that fills the
run directory's filesystem at a given step, as another job writing to the same volume would, so
that the next checkpoint write meets ENOSPC for real."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytorch_lightning as pl

BALLAST = "ballast.bin"  # the file FillDisk writes, beside the run directory


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's form: 4m) mounted on `where` for the duration: a filesystem other
    than the system temp directory's, as a cluster's scratch volume is. Needs root (the suite's
    machines run as root)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


class FillDisk(pl.Callback):
    """At step `at_step`, rank 0 fills the filesystem of `volume` to `leave_bytes` free, with a
    file of its own there that the run does not own; once: a run resumed from this one (the same
    callback in its config) finds the file and leaves the disk as it is."""

    def __init__(self, volume: str, at_step: int, leave_bytes: int) -> None:
        self.ballast, self.at_step, self.leave_bytes = Path(volume) / BALLAST, at_step, leave_bytes

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step != self.at_step or not trainer.is_global_zero or self.ballast.exists():
            return
        free = shutil.disk_usage(self.ballast.parent).free
        self.ballast.write_bytes(b"\0" * max(free - self.leave_bytes, 0))
