"""The progress bars of runner/rank/progress.py over several epochs of a run that max_steps bounds:
the count, the elapsed time and the rate are the run's, not the epoch's (Lightning restarts all
three at every epoch). A real Trainer in this process, a step taking STEP_S of wall time."""
from __future__ import annotations

import re
import time

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.rank.progress import RichStepsProgressBar, StepsProgressBar
from runner.records.files import PROGRESS_EVERY_ENV, PROGRESS_LINE_ENV

STEP_S = 0.4
STEPS, PER_EPOCH = 6, 2  # three epochs


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AtTheLastStep(pl.Callback):
    """The wall time since training started, and what `read(bar)` reads off the bar, at the last step."""

    def __init__(self, read) -> None:
        self.read, self.started, self.seen = read, 0.0, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == STEPS:
            self.seen = time.monotonic() - self.started, self.read(trainer.progress_bar_callback)


def tqdm_line(bar: StepsProgressBar) -> tuple:
    """(count, elapsed seconds, rate) as the drawn line shows them: "6/6 [00:02<00:00, 2.45it/s"."""
    shown = re.search(r"(\d+)/\d+ \[(\d+):(\d+)<[^,]*,\s*([\d.]+)it/s", str(bar.train_progress_bar))
    assert shown, str(bar.train_progress_bar)
    return int(shown.group(1)), 60 * int(shown.group(2)) + int(shown.group(3)), float(shown.group(4))


def rich_task(bar: RichStepsProgressBar) -> tuple:
    """(count, elapsed seconds, rate) of the rich bar's training task, which its columns show."""
    task = bar.progress.tasks[bar.train_progress_bar_id]
    return int(task.completed), task.elapsed, task.speed


@pytest.mark.parametrize("bar, read", [(StepsProgressBar, tqdm_line), (RichStepsProgressBar, rich_task)],
                         ids=["tqdm", "rich"])
def test_the_bars_clock_and_rate_run_across_epochs(bar, read, tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_LINE_ENV, raising=False)  # drawn here, not relayed
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")  # its line due at every step, so the last step's is read
    probe = AtTheLastStep(read)
    data = DataLoader(TensorDataset(torch.zeros(PER_EPOCH, 2)), batch_size=1)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
               enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
               callbacks=[bar(), probe]).fit(Tiny(), data)
    wall, (count, elapsed, rate) = probe.seen
    assert count == STEPS
    # tqdm shows whole seconds; Lightning's reset at each epoch would show the last epoch's 0.8 s
    assert wall - 1 <= elapsed <= wall + 0.5, (wall, elapsed)
    assert 0.7 * STEPS / wall <= rate <= 1.3 * STEPS / wall, (wall, rate)
