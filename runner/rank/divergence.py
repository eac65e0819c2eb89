"""Non-finite training stops the run (docs/reliability.md, "Faults at a cluster's edges"): a loss
or a parameter that becomes NaN or Inf ends it with status `diverged`, one line naming the step and
the last checkpoint written before it, and no checkpoint with non-finite weights is ever written.
`stop_on_nonfinite=false` turns the guard off. It lives in the preemption callback
(runner/rank/preemption.py), whose vote carries its flag.

Cheap on the hot path: a micro-batch's loss is kept as it is, with its step, and no host-device
sync is added; the kept losses are checked together, a few tiny device ops, where the flag is
made. The flag is read where a read happens already: in several processes it rides in the
preemption vote's all-reduce, read one step later, so every rank stops at the same step; in one
process at the logging steps, where the loggers, the bar and the meter read the device anyway. Before any checkpoint is written, and when fit ends, the
flag and the parameters themselves are checked at once and agreed by every rank (one all-reduce):
a checkpoint is rare beside a step, and the parameters are what it would keep.

amp's float16 loss scaler skips the steps whose scaled gradients overflow (plugins/amp.py): the
loss it is given is unscaled and a skipped step leaves the parameters as they were, so such steps
never trip the guard. A non-finite loss does, under amp too: no loss scale cures a forward that
overflows.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional

import pytorch_lightning as pl
import torch
from torch.distributed.tensor import DTensor


class Diverged(Exception):
    """Raised on every rank alike when the guard finds a non-finite loss or parameter."""

    def __init__(self, what: str, step: int, checkpoint: Optional[str]) -> None:
        before = f"the last checkpoint written before it: {checkpoint}" if checkpoint else \
            "no checkpoint was written before it"
        super().__init__(f"diverged: {what} became non-finite (NaN or Inf) at step {step}; {before}")
        self.step = step


NONE_YET = 2**62  # above any step: the minimum over steps whose losses were all finite
KEPT_AT_MOST = 1000  # losses kept before they are checked, whatever the logging interval


class NonFiniteGuard:
    """The first optimizer step whose loss was non-finite, kept on the losses' device (0: none
    yet). The micro-batches' losses are kept as they come, with their steps, and checked together
    where the flag is made: every step in several processes (the vote), at the logging steps in
    one; a micro-batch itself costs no device op."""

    def __init__(self) -> None:
        self.losses: List[torch.Tensor] = []  # the losses noted since the flag was last made
        self.steps: List[int] = []  # the optimizer step each of them belongs to, once it has ended
        self.first: Optional[torch.Tensor] = None  # int64 scalar: the first step whose loss was non-finite

    def note(self, outputs: Any) -> None:
        """A micro-batch's training_step output (its loss; manual optimisation may return none)."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())

    def fold(self, step: int) -> None:
        """At the end of optimizer step `step` (>= 1): the losses noted since the last fold were its."""
        self.steps += [step] * (len(self.losses) - len(self.steps))
        if len(self.steps) >= KEPT_AT_MOST:  # a run that never logs: checked now and then all the same
            self.flag(self.losses[0].device)

    def flag(self, device: torch.device) -> torch.Tensor:
        """The first bad step as a one-element tensor on `device`, for the vote (no sync)."""
        if self.steps:
            ended, steps = len(self.steps), self.steps
            losses, self.losses, self.steps = self.losses[:ended], self.losses[ended:], []
            bad = ~torch.cat([loss.reshape(-1) for loss in losses]).isfinite()
            if steps[0] == steps[-1]:  # one step's (every step in several processes): no tensor of steps to copy
                first = torch.where(bad.any(), steps[0], 0)
            else:  # several steps' (at a logging step in one process, where the device is read anyway)
                of_values = torch.tensor([step for step, loss in zip(steps, losses) for _ in range(loss.numel())])
                found = torch.where(bad, of_values.to(bad.device), NONE_YET).min()  # NONE_YET: all finite
                first = torch.where(found == NONE_YET, 0, found)
            self.first = first if self.first is None else torch.where(self.first > 0, self.first, first)
        if self.first is None:
            return torch.zeros(1, dtype=torch.int64, device=device)
        return self.first.to(device).view(1)

    def check(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        """Raise Diverged, on every rank alike, if a loss so far or a parameter now is non-finite:
        a sync and one all-reduce, for the rare moments it is worth it (a checkpoint, fit's end)."""
        device = trainer.strategy.root_device
        # Each rank's own part of a sharded parameter; the all-reduce below joins the parts.
        finite = [(p.to_local() if isinstance(p, DTensor) else p).detach().isfinite().all().to(device)
                  for p in module.parameters()]
        bad_parameter = ~torch.stack(finite).all() if finite else torch.zeros((), dtype=torch.bool, device=device)
        found = torch.cat([self.flag(device), bad_parameter.view(1).to(torch.int64)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        first, parameter = found.tolist()
        if first:
            raise diverged(trainer, "the loss", first)
        if parameter:
            raise diverged(trainer, "a parameter", trainer.global_step)


def diverged(trainer: pl.Trainer, what: str, step: int) -> Diverged:
    """Diverged at `step`, naming the newest checkpoint this run's checkpoint callback wrote (the
    guard checks every checkpoint before it is written, so that one is finite)."""
    callback = trainer.checkpoint_callback
    written = callback and (callback.last_model_path or callback.best_model_path)
    return Diverged(what, step, written or None)
