"""Checkpoint directories written whole or not at all: Lightning's ModelParallelStrategy (sharding
stages 2/3, the pipeline) writes torch's distributed checkpoint, every rank its own files, straight
into the checkpoint's directory, and its metadata file with a plain torch.save, so a rank that
fails mid-way leaves a half directory under the checkpoint's name. Here every rank writes into a
temporary directory beside it, the ranks agree that all of them succeeded, and rank 0 renames it
into place and writes its manifest last (runner/records/checkpoints.py: commit_directory).
"""
from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from lightning_fabric.strategies.model_parallel import _distributed_checkpoint_save
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from plugins.rehearsal import rehearsing
from runner.core.errors import first_line
from runner.records import checkpoints


class WholeCheckpointStrategy(ModelParallelStrategy):
    """ModelParallelStrategy whose checkpoint directories appear whole or not at all."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if rehearsing() else super().broadcast(obj, src)  # plugins/rehearsal.py: no objects in a fake world

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint or storage_options is not None:  # one file: the CheckpointIO's
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Retention's removals run in the CheckpointIO's writer (runner/rank/checkpoint_io.py), in
        # order: done before a directory is written, as one of them may name its path.
        self.checkpoint_io.teardown()
        path = Path(self.broadcast(filepath))
        written = Path(self.broadcast(str(checkpoints.temporary(path))))  # rank 0's name, for every rank
        if self.global_rank == 0:
            checkpoints.remove_leftovers(path.parent)
            shutil.rmtree(written, ignore_errors=True)
            written.mkdir(parents=True)
        self.barrier("checkpoint directory made")
        state = {"state_dict": checkpoint.pop("state_dict"),
                 **{f"optimizer_{index}": optimizer
                    for index, optimizer in enumerate(checkpoint.pop("optimizer_states", []))}}
        failure: Optional[BaseException] = None
        try:
            _distributed_checkpoint_save(state, written)  # every rank's files, each fsynced
            if self.global_rank == 0:
                meta = io.BytesIO()
                torch.save(checkpoint, meta)
                checkpoints.write_atomically(written / _METADATA_FILENAME, meta.getbuffer())
        except (Exception, CheckpointException) as error:  # noqa: BLE001 (torch's is a BaseException)
            failure = error  # the ranks decide together, below
        if not self.reduce_boolean_decision(failure is None, all=True):
            if self.global_rank == 0:
                shutil.rmtree(written, ignore_errors=True)
            if failure is not None and checkpoints.is_full_disk(failure):
                needed = sum(value.numel() * value.element_size() for value in _tensors(state))
                raise checkpoints.CheckpointNotWritten(checkpoints.full_disk_line(path, needed)) from failure
            if isinstance(failure, Exception):
                raise failure
            # torch's CheckpointException escapes `except Exception`: a RuntimeError is the rank's one line
            raise RuntimeError(f"checkpoint {path} was not written: "
                               f"{'another rank failed' if failure is None else first_line(failure)}") from failure
        if self.global_rank == 0:
            checkpoints.commit_directory(written, path, int(checkpoint.get("global_step", -1)))
        self.barrier("checkpoint directory in place")


def _tensors(state: Any):
    """Every tensor in a nested state (its local shard for a DTensor)."""
    if isinstance(state, torch.Tensor):
        yield getattr(state, "_local_tensor", state)
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)
