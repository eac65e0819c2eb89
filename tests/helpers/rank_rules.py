"""What each rank starts training from, for the rules of a resume on another number of processes
(tests/test_resume_rules.py): `StartState` (`+callbacks.start._target_=tests.helpers.rank_rules.StartState`)
saves it in the run directory as start.rank<R>.pt when the first training batch starts, after
every callback's on_train_start (the random generators, dgc's and local SGD's state applied)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from tests.helpers.probe import floating_buffers


class StartState(pl.Callback):
    def __init__(self) -> None:
        self.saved = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.saved:
            return
        self.saved = True
        hook_state = getattr(trainer.strategy, "comm_hook_state", None)
        averaging = {name: getattr(callback, name) for callback in trainer.callbacks
                     for name in ("syncs", "k_steps", "lr0", "loss0", "next_average_step") if hasattr(callback, name)}
        torch.save({"global_step": trainer.global_step,
                    "parameters": {name: p.detach().clone() for name, p in pl_module.named_parameters()},
                    "buffers": floating_buffers(pl_module),
                    "optimizer": trainer.optimizers[0].state_dict(),
                    "precision": trainer.precision_plugin.state_dict(),
                    "dgc": hook_state.state_dict() if hasattr(hook_state, "state_dict") else None,
                    "averaging": averaging,
                    "torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                   Path(trainer.default_root_dir) / f"start.rank{trainer.global_rank}.pt")
