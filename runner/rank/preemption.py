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

The vote also carries the guard against non-finite training (runner/rank/divergence.py): the first
step whose loss was NaN or Inf, so that every rank stops at the same step without a sync of its own.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, List, Optional

import pytorch_lightning as pl
import torch

from runner.rank.checkpoint_io import AtomicCheckpointIO
from runner.rank.divergence import Diverged, NonFiniteGuard, diverged
from runner.rank.hooks import OwnHooksOnly
from runner.rank.parent import COMMAND_PID, SIGNALS, exit_status
from runner.rank.progress import logging_step
from runner.records.files import LAST_CHECKPOINT

FAILURE_GRACE_S = 2.0  # how long a failing rank of several waits for the agent to stop it (on_exception)


class Preempted(SystemExit):
    """Raised on every rank at the agreed step, once its checkpoint is saved; or at once, with no
    step, by a signal that came before training started (or by a second Ctrl-C)."""

    def __init__(self, signum: int, step: Optional[int] = None) -> None:
        super().__init__(exit_status(signum))
        self.signum, self.step = signum, step


class Preemption(OwnHooksOnly):
    """Checkpoint at the step a preemption signal arrives in, on every rank alike; and, with
    `stop_on_nonfinite`, stop where the loss or a parameter became non-finite (Diverged)."""

    def __init__(self, checkpoint: str = LAST_CHECKPOINT, stop_on_nonfinite: bool = True) -> None:
        self.checkpoint = checkpoint  # relative: under the run directory (the trainer's default_root_dir)
        self.received = 0  # the signal's number; 0 while none came
        self.agreed_signal = 0
        self.guard = NonFiniteGuard() if stop_on_nonfinite else None
        self.diverged_at = 0  # the first step with a non-finite loss, once read
        self.last_step = -1
        self.checked_step = -1  # the step whose weights the guard last found finite before a checkpoint
        self._vote: Optional[Vote] = None  # the vote under way
        self._writes: Optional[AtomicCheckpointIO] = None  # the run's background checkpoint writer

    def note(self, signum: int, _frame: Any = None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # Ctrl-C twice: stop now
            raise Preempted(signum)
        self.received = self.received or signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for signum in SIGNALS:  # after Lightning's, which its fit loop acts on rank by rank
            signal.signal(signum, self.note)
        if trainer.received_sigterm:  # Lightning's handler took one while fit was setting up
            raise Preempted(signal.SIGTERM)
        writes = trainer.strategy.checkpoint_io
        self._writes = writes if isinstance(writes, AtomicCheckpointIO) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           *args: Any) -> None:
        if self.guard is not None:
            self.guard.note(outputs)
        step = trainer.global_step  # read once: Lightning's property walks its loops (~1 us)
        if step == self.last_step:  # a micro-batch of an accumulated step
            return
        self.last_step = step
        if self._writes is not None:  # a checkpoint the disk refused in the background stops the run here
            self._writes.raise_failure()
        if self.guard is not None and step > 0:
            self.guard.fold(step)
        stop = self.agreed(trainer)
        if self.diverged_at:  # before any checkpoint: its weights are not finite
            raise diverged(trainer, "the loss", self.diverged_at)
        if stop:
            trainer.save_checkpoint(str(Path(trainer.default_root_dir) / self.checkpoint), weights_only=False)
            trainer.strategy.checkpoint_io.teardown()  # on the disk before the exit: the resume point
            raise Preempted(self.agreed_signal, trainer.global_step)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        # Called on every rank before anything is written (Lightning calls the checkpoint callbacks'
        # save after this callback's step hooks): a checkpoint with non-finite weights never replaces
        # a good one. Not called for a ModelCheckpoint's save_weights_only files. Once a step: the
        # weights are those of its optimizer step until the next (the top-k file and last.ckpt).
        if self.guard is not None and trainer.global_step != self.checked_step:
            self.guard.check(trainer, pl_module)
            self.checked_step = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A rank of several that fails waits FAILURE_GRACE_S before it goes on to report, ending at
        once, silently, when the elastic agent stops it (SIGTERM) meanwhile or has already: a rank
        whose peer died (SIGKILL by the out-of-memory killer) fails at once on the lost connection,
        and so the agent sees the dead peer first, the command's summary names it, and this rank's
        consequent error stays off the console."""
        if isinstance(exception, (Preempted, Diverged)) or COMMAND_PID not in os.environ:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.received == signal.SIGTERM:  # noted before this hook
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(FAILURE_GRACE_S)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count_vote()  # no collective left under way when fit ends
        if self.guard is not None:  # the last steps' losses, and the weights fit ends with
            self.guard.check(trainer, pl_module)

    def agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank had received a signal by the end of the previous step (the largest
        number wins), and start the vote of this one. In a single process: a signal so far."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.agreed_signal = self.received
            if self.guard is not None and logging_step(trainer):  # where the device is read anyway
                self.diverged_at = int(self.guard.flag(trainer.strategy.root_device))
            return self.agreed_signal != 0
        self._count_vote()
        device = trainer.strategy.root_device
        self._vote = Vote(self.received, device, None if self.guard is None else self.guard.flag(device))
        return self.agreed_signal != 0

    def _count_vote(self) -> None:
        if self._vote is not None:
            self.agreed_signal, *guard = self._vote.result()
            self.diverged_at, self._vote = (guard[0] if guard else 0), None


class Vote:
    """One all-reduce (max) of each rank's signal number, and of `guard` (the first step whose loss
    was non-finite) when given, in the background. On CUDA its result is copied to pinned host
    memory behind the collective, with an event: reading it waits for that copy, never for the
    device's later work (an `.item()` would wait for all of it)."""

    def __init__(self, signum: int, device: torch.device, guard: Optional[torch.Tensor] = None) -> None:
        self.flag = torch.full((1,), signum, dtype=torch.int64, device=device)  # filled on the device: no copy
        if guard is not None:
            self.flag = torch.cat([self.flag, guard])
        self.work = torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self.copied: Optional[torch.cuda.Event] = None
        if device.type == "cuda":
            self.work.wait()  # NCCL: the current stream waits for the collective; the host does not
            self.host = torch.empty(len(self.flag), dtype=torch.int64, pin_memory=True)
            self.host.copy_(self.flag, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def result(self) -> List[int]:
        """The signal number, then the guard's step if it voted."""
        if self.copied is None:
            self.work.wait()
            return self.flag.tolist()  # a host tensor (gloo)
        self.copied.synchronize()
        return self.host.tolist()


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
