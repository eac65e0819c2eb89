"""Preemption as on a cluster: SIGTERM, or SIGUSR1 (SLURM's warning before the time limit), or
SIGINT (Ctrl-C) while training makes every rank finish the step it is in, save
checkpoints/last.ckpt at that step, and exit; `lightfleet resume RUN_DIR` continues from there
(docs/reliability.md). A second Ctrl-C stops at once.

The signal handlers only note the signal. The ranks vote at the end of each optimizer step, with
one small all-reduce, whether any rank has one, so all stop at the same step and save together
(a sharded checkpoint is collective). The vote runs in the background while the next step
computes and is read at that step's end: the ranks stop one step after the signal, and the
vote's latency is hidden (bench/preemption.py). On a GPU the vote's result reaches the host by a
copy into pinned memory, and reading it waits for that copy alone, not for the step under way: a
plain loop makes the host wait for the device nowhere per step, and neither does the vote. A
single process votes with no one: it reads its own signal. Lightning's own SIGTERM handling is replaced: it stops
ranks at different steps. Before training starts, a signal stops the run at once, without a
checkpoint (runner/command/launch.py; in a rank, runner/rank/parent.py).
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from runner.rank.parent import SIGNALS, exit_status
from runner.records.files import LAST_CHECKPOINT

class Preempted(SystemExit):
    """Raised on every rank at the agreed step, once its checkpoint is saved; or at once, with no
    step, by a signal that came before training started (or by a second Ctrl-C)."""

    def __init__(self, signum: int, step: Optional[int] = None) -> None:
        super().__init__(exit_status(signum))
        self.signum, self.step = signum, step


class Preemption(pl.Callback):
    """Checkpoint at the step a preemption signal arrives in, on every rank alike."""

    def __init__(self, checkpoint: str = LAST_CHECKPOINT) -> None:
        self.checkpoint = checkpoint  # relative: under the run directory (the trainer's default_root_dir)
        self.received = 0  # the signal's number; 0 while none came
        self.agreed_signal = 0
        self.last_step = -1
        self._vote: Optional[Vote] = None  # the vote under way

    def note(self, signum: int, _frame: Any = None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # Ctrl-C twice: stop now
            raise Preempted(signum)
        self.received = self.received or signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for signum in SIGNALS:  # after Lightning's, which its fit loop acts on rank by rank
            signal.signal(signum, self.note)
        if trainer.received_sigterm:  # Lightning's handler took one while fit was setting up
            raise Preempted(signal.SIGTERM)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.last_step:  # a micro-batch of an accumulated step
            return
        self.last_step = trainer.global_step
        if self.agreed(trainer):
            trainer.save_checkpoint(str(Path(trainer.default_root_dir) / self.checkpoint), weights_only=False)
            raise Preempted(self.agreed_signal, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count_vote()  # no collective left under way when fit ends

    def agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank had received a signal by the end of the previous step (the largest
        number wins), and start the vote of this one. In a single process: a signal so far."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.agreed_signal = self.received
            return self.agreed_signal != 0
        self._count_vote()
        self._vote = Vote(self.received, trainer.strategy.root_device)
        return self.agreed_signal != 0

    def _count_vote(self) -> None:
        if self._vote is not None:
            self.agreed_signal, self._vote = self._vote.result(), None


class Vote:
    """One all-reduce (max) of each rank's signal number, in the background. On CUDA its result
    is copied to pinned host memory behind the collective, with an event: reading it waits for
    that copy, never for the device's later work (an `.item()` would wait for all of it)."""

    def __init__(self, signum: int, device: torch.device) -> None:
        self.flag = torch.full((1,), signum, dtype=torch.int64, device=device)  # filled on the device: no copy
        self.work = torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self.copied: Optional[torch.cuda.Event] = None
        if device.type == "cuda":
            self.work.wait()  # NCCL: the current stream waits for the collective; the host does not
            self.host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self.host.copy_(self.flag, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def result(self) -> int:
        if self.copied is None:
            self.work.wait()
            return int(self.flag[0])  # a host tensor (gloo)
        self.copied.synchronize()
        return int(self.host[0])


def resume_line(run_dir: Path, signum: int, step: Optional[int] = None) -> str:
    """What the command says when a signal stopped its run: with the checkpoint the ranks saved,
    or, stopped before there was one, that a resume starts the run again."""
    how = "interrupted" if signum == signal.SIGINT else "preempted"
    if (run_dir / LAST_CHECKPOINT).exists():
        at = f" at step {step}" if step is not None else ""
        saved = f"checkpoint saved in {run_dir / LAST_CHECKPOINT}"
    else:
        at, saved = "", "no checkpoint was saved yet, so resuming starts the run again"
    return f"lightfleet: {how} by {signal.Signals(signum).name}{at}; {saved}; continue with: lightfleet resume {run_dir}"
