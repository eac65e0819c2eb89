"""Adaptive local SGD (Fleet `strategy.adaptive_localsgd`; Wang & Joshi, "Adaptive Communication
Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update SGD", arXiv 1810.08313):
local SGD whose averaging period k follows the training loss and the learning rate.

The gradient communication is local SGD's (`plugins.localsgd:build_hook`): all-reduced for the
first `begin_step` optimizer steps, local afterwards. `AdaptiveModelAveraging` then, as Fleet's
AdaptiveLocalSGDOptimizer does:

- after step `begin_step` (the last synchronous one) records the reference loss0 (the training
  loss averaged over all processes) and lr0 (the learning rate of the first parameter group), and
  sets k = init_k_steps;
- averages the parameters over all processes k steps after the previous averaging (or after
  begin_step), and there sets the next period from the loss averaged over all processes and the
  current learning rate lr:

      k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)), clipped to [1, 16].

Direction: with a constant learning rate the period SHRINKS as the loss falls (k <= ceil(sqrt(
init_k_steps)) once loss < loss0); it grows when the learning rate decays faster than the loss
falls (lr0 / lr > loss0 / loss). The paper's AdaComm likewise communicates more often as the loss
falls, and increases the period when the learning rate decays. Fleet's formula keeps init_k_steps
inside the square root, and so does this one.

The loss is the step's `training_step` loss as Lightning hands it to `on_train_batch_end` (under
gradient accumulation: the last micro-batch's, divided by the accumulation count, in loss0 alike).
The learning rate is read after the optimizer step and any per-step LR scheduler step: the rate
the next local steps will use. Every rank logs `localsgd_k` (the current period) and
`localsgd_syncs`; the callback's state (k, loss0, lr0, next averaging step) is checkpointed.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups
from typing_extensions import override

from plugins.localsgd import LocalSGDCallback

MIN_K_STEPS, MAX_K_STEPS = 1, 16


def next_k_steps(lr0: float, loss0: float, lr: float, loss: float, init_k_steps: int) -> int:
    """Fleet's adaptive period: ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)) in [1, 16]."""
    k = math.ceil(math.sqrt(lr0 * loss / (lr * loss0) * init_k_steps))
    return min(max(k, MIN_K_STEPS), MAX_K_STEPS)


def averaged_loss(outputs: Any, device: torch.device) -> float:
    """The training loss of this step (what Lightning passes to `on_train_batch_end`: the
    `training_step` output, a tensor or a dict with "loss") averaged over all processes."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError("adaptive local SGD needs training_step to return the loss (a tensor or a dict "
                           "with 'loss')")
    loss = loss.detach().to(device=device, dtype=torch.float64).reshape(1).clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


class AdaptiveModelAveraging(LocalSGDCallback):
    """Average the parameters over all processes with a period adapted to the loss (see the
    module docstring); pair with `plugins.localsgd:build_hook(begin_step)`."""

    def __init__(self, init_k_steps: int = 1, begin_step: int = 1) -> None:
        super().__init__(begin_step)
        if init_k_steps < 1:
            raise ValueError(f"init_k_steps must be >= 1, got {init_k_steps}")
        self.init_k_steps = init_k_steps
        self.k_steps = init_k_steps
        self.lr0: Optional[float] = None
        self.loss0: Optional[float] = None
        self.next_average_step = begin_step + init_k_steps

    @override
    def after_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                             step: int) -> bool:
        averaged = False
        if self.loss0 is None:
            if step >= self.begin_step:  # the last synchronous step (or the first one seen, past it)
                self.loss0, self.lr0 = averaged_loss(outputs, pl_module.device), self.learning_rate(trainer)
                self.k_steps = self.init_k_steps
                self.next_average_step = step + self.k_steps
        elif step >= self.next_average_step:
            average_parameters_or_parameter_groups(pl_module.parameters(), dist.group.WORLD)
            loss, lr = averaged_loss(outputs, pl_module.device), self.learning_rate(trainer)
            self.k_steps = next_k_steps(self.lr0, self.loss0, lr, loss, self.init_k_steps)
            self.next_average_step = step + self.k_steps
            averaged = True
        pl_module.log("localsgd_k", float(self.k_steps), on_step=True, on_epoch=False)
        return averaged

    @staticmethod
    def learning_rate(trainer: pl.Trainer) -> float:
        return float(trainer.optimizers[0].param_groups[0]["lr"])

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "k_steps": self.k_steps, "lr0": self.lr0, "loss0": self.loss0,
                "next_average_step": self.next_average_step}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.k_steps, self.lr0, self.loss0 = state_dict["k_steps"], state_dict["lr0"], state_dict["loss0"]
        self.next_average_step = state_dict["next_average_step"]
