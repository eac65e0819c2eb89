"""The progress bar of a run that `trainer.max_steps` bounds: it counts the run's optimizer steps
("Epoch 1, step: 75%|...| 45/60"). Lightning's bars count the batches of each epoch and start
again at every epoch, and its rich bar reads "Epoch 1/-2" (max_epochs is -1 when steps bound the
run). Where epochs bound the run, both behave exactly as Lightning's. The plan adds
`StepsProgressBar` unless the config's callbacks bring a bar (runner/config/checks.py);
conf/callbacks/rich_progress_bar.yaml brings `RichStepsProgressBar`.
"""
from __future__ import annotations

from typing import Any, Union

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


def bounded_by_steps(trainer: "pl.Trainer") -> bool:
    """Whether max_steps ends the run: Lightning's own test (ProgressBar.total_train_batches)."""
    return trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0


def steps_description(epoch: int) -> str:
    return f"Epoch {epoch}, step"


class _CountsSteps:
    """What both bars share: the total is max_steps and the count the global step."""

    trainer: "pl.Trainer"

    @property
    def total_train_batches(self) -> Union[int, float]:
        return self.trainer.max_steps if bounded_by_steps(self.trainer) else super().total_train_batches

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning's bars show batch_idx + 1; a run bounded by steps shows its steps instead.
        shown = trainer.global_step - 1 if bounded_by_steps(trainer) else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)


class StepsProgressBar(_CountsSteps, TQDMProgressBar):
    """Lightning's default (tqdm) bar, counting steps where steps bound the run."""

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if bounded_by_steps(trainer):  # the count goes on from the steps already taken (also after a resume)
            bar = self.train_progress_bar
            bar.initial = bar.n = trainer.global_step
            bar.set_description(steps_description(trainer.current_epoch))


class RichStepsProgressBar(_CountsSteps, RichProgressBar):
    """Lightning's rich bar, counting steps where steps bound the run."""

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if bounded_by_steps(trainer) and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
            self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        if not bounded_by_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        # padded as Lightning pads it: "Validation" below would otherwise shift the bar
        return f"{steps_description(current_epoch):{len(self.validation_description)}}"
