"""The progress bar of a run that `trainer.max_steps` bounds: it counts the run's optimizer steps
("Epoch 1, step: 75%|...| 45/60"). Lightning's bars count the batches of each epoch and start
again at every epoch, and its rich bar reads "Epoch 1/-2" (max_epochs is -1 when steps bound the
run). Where epochs bound the run, both behave exactly as Lightning's. The plan adds
`StepsProgressBar` unless the config's callbacks bring a bar (runner/rank/callbacks.py);
conf/callbacks/rich_progress_bar.yaml brings `RichStepsProgressBar`. Neither shows Lightning's
`v_num` (the logger's version: "csv").

Both show the training loss as read at logging steps (every `trainer.log_every_n_steps`, the first
and the last step), never at every micro-batch: reading a value off a GPU waits for the device,
which a plain training loop does not do per micro-batch. The built-in models log `train_loss`
without `prog_bar` for that reason (Lightning turns a progress-bar metric into a number after
every batch).

In a run of several processes, each line a rank writes reaches the console as a line of its own
("[rank0]:..."), so a bar would print a line per refresh. There `StepsProgressBar` draws into
`ProgressRelay`, a file holding its latest line (PROGRESS_LINE_ENV names it), and the command draws that
line in place (runner/command/console.py).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

from runner.records.files import PLAIN_EVERY_S, PROGRESS_EVERY_ENV, PROGRESS_LINE_ENV, progress_every_s

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def bounded_by_steps(trainer: "pl.Trainer") -> bool:
    """Whether max_steps ends the run: Lightning's own test (ProgressBar.total_train_batches)."""
    return trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0


def steps_description(epoch: int) -> str:
    return f"Epoch {epoch}, step"


SHOWN_LOSS = "train_loss"  # what the built-in models log as their training loss


def logging_step(trainer: "pl.Trainer") -> bool:
    """Whether the optimizer step just taken is one whose figures are read: the first, the last and
    every `log_every_n_steps` (as Lightning's loggers and lightfleet's meter read theirs)."""
    step, every = trainer.global_step, trainer.log_every_n_steps
    return step > 0 and (step in (1, trainer.max_steps) or bool(every) and step % every == 0)


class _CountsSteps:
    """What both bars share: the total is max_steps and the count the global step; the loss is
    read at logging steps only."""

    trainer: "pl.Trainer"
    loss_read_at: int = -1  # the global step whose loss the bar shows
    shown_loss: Optional[float] = None

    @property
    def total_train_batches(self) -> Union[int, float]:
        return self.trainer.max_steps if bounded_by_steps(self.trainer) else super().total_train_batches

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self.loss_read_at and logging_step(trainer):
            self.loss_read_at = trainer.global_step
            loss = trainer.callback_metrics.get(SHOWN_LOSS)
            self.shown_loss = None if loss is None else float(loss)
        # Lightning's bars show batch_idx + 1; a run bounded by steps shows its steps instead.
        shown = trainer.global_step - 1 if bounded_by_steps(trainer) else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Dict[str, Union[int, str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        if self.shown_loss is not None:
            metrics = {SHOWN_LOSS: self.shown_loss, **metrics}
        return metrics


class ProgressRelay:
    """A text stream for tqdm that keeps only the line it draws last, in the file at `path`
    (replaced whole, so a reader never sees half a line)."""

    def __init__(self, path: Path) -> None:
        self.path, self.line = path, ""
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, text: str) -> int:
        parts = [part.strip() for part in re.split(r"[\r\n]", ANSI_ESCAPE.sub("", text))]
        line = next((part for part in reversed(parts) if part), self.line)  # a bar cleared on close keeps its line
        if line != self.line:
            self.line = line
            staged = self.path.with_suffix(".tmp")
            staged.write_text(line)
            os.replace(staged, self.path)
        return len(text)

    def flush(self) -> None:
        pass


class StepsProgressBar(_CountsSteps, TQDMProgressBar):
    """Lightning's default (tqdm) bar, counting steps where steps bound the run; into a
    ProgressRelay where the command draws it (PROGRESS_LINE_ENV). It redraws when its line is due
    (every `every_s`: a few times a second on a terminal, every 30 s elsewhere) and as it closes
    or the run stops, not at every batch as Lightning's does (refresh_rate=1): formatting and writing the line
    cost a 6 ms step about 27% (bench/RESULTS.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        relay, every = os.environ.get(PROGRESS_LINE_ENV), os.environ.get(PROGRESS_EVERY_ENV)
        self.relay = ProgressRelay(Path(relay)) if relay else None
        self.every_s = float(every) if every else progress_every_s(sys.stdout)
        self._due_at = 0.0

    def _due(self) -> bool:
        return time.monotonic() >= self._due_at

    def _drawn(self, make: Any) -> Any:
        """The bar `make()` builds, drawing into the relay if there is one (Lightning gives its bars
        sys.stdout), and only when its line is due: every redraw Lightning asks for (a step, an
        epoch's start and end, a validation's end) goes through its `refresh`; closing draws the last."""
        with contextlib.redirect_stdout(self.relay) if self.relay else contextlib.nullcontext():
            bar = make()
        refresh = bar.refresh

        def refresh_when_due(*args: Any, **kwargs: Any) -> Any:
            if not self._due():
                return None
            self._due_at = time.monotonic() + self.every_s
            return refresh(*args, **kwargs)

        bar.refresh = refresh_when_due
        return bar

    @override
    def _should_update(self, current: int, total: int) -> bool:
        return self.is_enabled and self._due()  # nor are the metrics read and formatted between redraws

    @override
    def init_sanity_tqdm(self) -> Any:
        return self._drawn(super().init_sanity_tqdm)

    @override
    def init_train_tqdm(self) -> Any:
        return self._drawn(super().init_train_tqdm)

    @override
    def init_validation_tqdm(self) -> Any:
        if self.every_s < PLAIN_EVERY_S:
            return self._drawn(super().init_validation_tqdm)
        # Off a terminal the line shown is the training bar's: a validation bar, made and drawn at
        # every validation, would only replace it.
        self._enabled = False
        try:
            return super().init_validation_tqdm()
        finally:
            self._enabled = True

    @override
    def init_predict_tqdm(self) -> Any:
        return self._drawn(super().init_predict_tqdm)

    @override
    def init_test_tqdm(self) -> Any:
        return self._drawn(super().init_test_tqdm)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_line(trainer, pl_module, draw=False)  # drawn as the bar closes
        super().on_train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._last_line(trainer, pl_module, draw=True)  # stopped (a preemption) or failed: where it got to

    def _last_line(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", draw: bool) -> None:
        bar = self._train_progress_bar
        if bar is None or bar.disable or not bounded_by_steps(trainer):
            return
        bar.n = trainer.global_step
        self._due_at = 0.0
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=draw)

    counting_since: Optional[Tuple[int, float]] = None  # the step and the time the bar started counting at

    @override
    def on_train_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.on_train_epoch_start(trainer, *args)  # Lightning does not call it for an epoch resumed midway

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        if not bounded_by_steps(trainer):
            return super().on_train_epoch_start(trainer, *args)
        # Lightning resets the bar at every epoch (count, clock, rate); this one counts the run's
        # steps (also after a resume), its time and rate since it started, across epochs.
        self.train_progress_bar.initial = 0  # the reset draws the bar once: not at a negative rate
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if bar.disable:  # the other ranks' bars draw nothing
            return
        if self.counting_since is None:
            self.counting_since = trainer.global_step, bar.start_t
            self._due_at = 0.0  # the run's first line drawn at once, not a due time later
        bar.initial, bar.start_t = self.counting_since
        bar.n = trainer.global_step
        bar.set_description(steps_description(trainer.current_epoch))


class RichStepsProgressBar(_CountsSteps, RichProgressBar):
    """Lightning's rich bar, counting steps where steps bound the run."""

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not bounded_by_steps(trainer):
            return super().on_train_epoch_start(trainer, pl_module)
        # Lightning resets the task at every epoch (count, clock, rate): this one makes it once and
        # counts the run's steps (from a resumed step on), its time and rate, across epochs
        if self.progress is None or self.train_progress_bar_id is None or self._leave:
            super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step,
                                 description=self._get_train_description(trainer.current_epoch))
            self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        if not bounded_by_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        # padded as Lightning pads it: "Validation" below would otherwise shift the bar
        return f"{steps_description(current_epoch):{len(self.validation_description)}}"
