"""lightfleet's CheckpointIO (in every run's plan, `<- lightfleet`): every single-file checkpoint
is written whole or not at all, with its manifest (runner/records/checkpoints.py), and read as
data only. Lightning's own writes through fsspec's transaction, a temporary file in the system
temp directory then a move, which across filesystems is a copy: a full disk leaves a truncated
file under the checkpoint's name. Checkpoint directories (sharding stages 2/3, the pipeline) are
written whole by their strategies (plugins/directory_checkpoint.py)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Set

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from runner.records import checkpoints


class AtomicCheckpointIO(TorchCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self._cleaned: Set[Path] = set()  # directories whose leftovers are removed already
        self._written: Optional[checkpoints.Written] = None  # the last file saved, which the same bytes link to

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent not in self._cleaned:  # what a crashed run left there, at this run's first write
            checkpoints.remove_leftovers(path.parent)
            self._cleaned.add(path.parent)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:
            self._written = checkpoints.save(path, buffer.getbuffer(), int(checkpoint.get("global_step", -1)),
                                             self._written)
        except OSError as error:
            if not checkpoints.is_full_disk(error):
                raise
            line = checkpoints.full_disk_line(path, buffer.getbuffer().nbytes)
            raise checkpoints.CheckpointNotWritten(line) from error

    @override
    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Data only, whatever the caller asks: a checkpoint's pickle never runs code."""
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """ModelCheckpoint's retention (save_top_k) removes through here: the manifest goes too."""
        checkpoints.remove(Path(path))
