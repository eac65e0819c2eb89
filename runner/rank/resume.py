"""What an exact resume needs in a checkpoint beyond Lightning's own state.

State that differs between ranks: only rank 0 writes a checkpoint, but every rank builds it
(Lightning calls the callbacks' `state_dict` on all of them), so a callback gathers each rank's
piece into it with `gather` and, on resume, each rank takes its own back with `own`
(plugins/ranks.py). `RandomStates` keeps every rank's random generators this way; `EpochEndPosition` makes a
checkpoint taken at an epoch's last batch resume at the next epoch's start
(docs/reliability.md#resume-bit-for-bit).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states
from typing_extensions import override

from plugins.ranks import gather, own


class RandomStates(pl.Callback):
    """Every rank's torch, CUDA, numpy and Python random generators, saved with each checkpoint
    and restored when training starts from one: a resumed run draws the dropout masks, the noise
    and the augmentations the uninterrupted run would have drawn."""

    def __init__(self) -> None:
        self._loaded: Optional[List[Dict[str, Any]]] = None

    @override
    def state_dict(self) -> Dict[str, Any]:
        states = _collect_rng_states(include_cuda=torch.cuda.is_available())
        # numpy's key array as a tensor: checkpoints load with weights_only, which refuses arrays.
        name, keys, *rest = states.pop("numpy")
        return {"ranks": gather({**states, "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest)})}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._loaded = state_dict["ranks"]  # applied when training starts: nothing draws after that

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loaded is not None:
            mine = own(self._loaded, "random generator states", "the generators go on from the seed")
            if mine is not None:
                name, keys, *rest = mine["numpy"]
                _set_rng_states({**mine, "numpy": (name, keys.numpy().astype(np.uint32), *rest)})
            self._loaded = None


class EpochEndPosition(pl.Callback):
    """A checkpoint taken at an epoch's last batch keeps no data loader position. Lightning
    resumes it at the next epoch, where the saved position (the end of the data) would make that
    epoch empty and shift every later one; without it the loader starts the epoch afresh."""

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: Dict[str, Any]) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            checkpoint["loops"]["fit_loop"]["state_dict"].pop("combined_loader", None)
