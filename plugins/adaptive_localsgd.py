"""Adaptive local SGD (Fleet `strategy.adaptive_localsgd`; Wang & Joshi, arXiv 1810.08313): local
SGD whose averaging period k follows the training loss and the learning rate.

Gradients travel as under local SGD (`plugins.localsgd:build_hook`). `AdaptiveModelAveraging`
records the loss and learning rate after step `begin_step`, averages the parameters k steps
after the previous averaging, and there sets the next period by Fleet's formula,
k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)) in [1, 16]. With a constant learning
rate the period shrinks as the loss falls. Every rank logs `localsgd_k` and `localsgd_syncs`.
Details: docs/strategies.md#adaptive_localsgd.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups
from typing_extensions import override

from plugins import traffic
from plugins.localsgd import LocalSGDCallback, count_averaging

MIN_K_STEPS, MAX_K_STEPS = 1, 16


def next_k_steps(lr0: float, loss0: float, lr: float, loss: float, init_k_steps: int) -> int:
    """Fleet's adaptive period: ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)) in [1, 16].
    A learning rate decayed to 0 (a cosine schedule's last step) or a first loss of 0 makes the
    quotient unbounded: the longest period."""
    if lr * loss0 <= 0:
        return MAX_K_STEPS
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
    traffic.count("all_reduce", loss)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


class AdaptiveModelAveraging(LocalSGDCallback):
    """Average the parameters over all processes with a period adapted to the loss (see the
    module docstring); pair with `plugins.localsgd:build_hook(begin_step)`."""

    def __init__(self, *, init_k_steps: int, begin_step: int) -> None:
        super().__init__(begin_step)
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
            count_averaging(pl_module.parameters())
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
