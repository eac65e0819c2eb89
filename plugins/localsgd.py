"""Local SGD (Fleet `strategy.localsgd`; Lin et al., arXiv 1808.07217): synchronous data
parallelism for the first `begin_step` optimizer steps, then every process steps on its own and
the parameters are averaged across all processes every `k_steps` steps (after steps begin_step
+ k_steps, begin_step + 2 k_steps, ..., as Fleet does). Built from torch's post-local-SGD
pieces: `build_hook` (gradients all-reduced, then local) and `ModelAveraging`, a callback
running `PeriodicModelAverager`. Every rank logs `localsgd_syncs`. How the two count steps, also
after a resume: docs/strategies.md#localsgd.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import get_params_to_average
from typing_extensions import override

from plugins import traffic
from plugins.ranks import averaged, gather, own


def build_hook(begin_step: int) -> Tuple[PostLocalSGDState, Callable]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook`: gradients all-reduced over
    the world group for the first `begin_step` iterations, purely local afterwards."""
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=begin_step,
                              post_local_gradient_allreduce=False)
    return state, counted_post_localSGD_hook if traffic.counting() else post_localSGD_hook


def counted_post_localSGD_hook(state, bucket):  # no annotations: DDP checks them, and these would be strings
    """torch's `post_localSGD_hook`, counting the gradient all-reduce it makes while synchronous."""
    if state.iter < state.start_localSGD_iter:
        traffic.count("all_reduce", bucket.buffer(), state.process_group)
    return post_localSGD_hook(state, bucket)


def count_averaging(parameters: Any) -> None:
    """Count the parameter averaging torch's model averaging makes: one all-reduce over the world
    of the parameters that have gradients, flattened."""
    if traffic.counting():
        traffic.count("all_reduce", sum(p.numel() * p.element_size() for p in get_params_to_average(parameters)))


class LocalSGDCallback(pl.Callback):
    """What local-SGD callbacks share: once training starts, line up the hook's iteration count
    with `trainer.global_step`; after each optimizer step (not after accumulating micro-batches),
    call `after_optimizer_step` and log `localsgd_syncs`. In a single process it only takes a
    checkpoint's replicas (below). The knobs come checked by the strategies' dataclasses
    (runner/strategies/localsgd.py, adaptive_localsgd.py), where their ranges live.

    Between averagings every rank trains a replica of its own, and a checkpoint holds them all.
    Resumed on another number of processes (one included), every rank starts from their average,
    what the next averaging would have given: the parameters and the optimizer's state averaged,
    the loss scaler (the same on every rank: its overflow flag is all-reduced) and the counters
    carried. A 1-process checkpoint's model is the one replica every rank of a larger world takes."""

    RULE = averaged("every rank starts from their average (parameters and optimizer state), as the next "
                    "averaging would have made it")

    def __init__(self, begin_step: int) -> None:
        self.begin_step = begin_step
        self.syncs = 0  # parameter averagings so far
        self._steps_seen = 0
        self._trainer: Optional[pl.Trainer] = None
        self._replicas: Optional[List[Dict[str, Any]]] = None  # loaded, applied when training starts

    def after_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                             step: int) -> bool:
        """Called after optimizer step `step` (1-based) in a multi-process run; True when it
        averaged the parameters."""
        raise NotImplementedError

    @staticmethod
    def distributed(trainer: pl.Trainer) -> bool:
        return dist.is_available() and dist.is_initialized() and trainer.world_size > 1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_seen = trainer.global_step
        self._restore_replica(trainer, pl_module)  # in one process too: the replicas' average
        if not self.distributed(trainer):
            return
        state = getattr(trainer.strategy, "comm_hook_state", None)
        if not isinstance(state, PostLocalSGDState):
            raise RuntimeError(f"{type(self).__name__} needs the DDP communication hook of "
                               "plugins.localsgd:build_hook (FleetDDPStrategy(comm_hook=...)); without it the "
                               "gradients are all-reduced at every step")
        if state.start_localSGD_iter != self.begin_step:
            raise RuntimeError(f"{type(self).__name__}(begin_step={self.begin_step}) and the communication hook "
                               f"(begin_step={state.start_localSGD_iter}) disagree")
        # The hook counts iterations only until it turns local; on resume it restarts from 0.
        state.iter = min(trainer.global_step, state.start_localSGD_iter)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._steps_seen:  # accumulating micro-batches: no step taken
            return
        self._steps_seen = trainer.global_step
        if not self.distributed(trainer):
            return
        if self.after_optimizer_step(trainer, pl_module, outputs, trainer.global_step):
            self.syncs += 1
        pl_module.log("localsgd_syncs", float(self.syncs), on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> Dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not self.distributed(trainer):
            return {"syncs": self.syncs}
        # Between averagings each rank trains its own replica: the checkpoint (rank 0's model,
        # optimizer and loss scaler) gets every rank's, and each rank takes its own back.
        parameters = trainer.lightning_module.named_parameters()
        replica = {"parameters": {name: p.detach().cpu().clone() for name, p in parameters},
                   "optimizer": trainer.optimizers[0].state_dict(),
                   "precision": trainer.precision_plugin.state_dict()}
        return {"syncs": self.syncs, "replicas": gather(replica)}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.syncs = state_dict["syncs"]
        self._replicas = state_dict.get("replicas")

    def _restore_replica(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        replicas, self._replicas = self._replicas, None
        if replicas is None:
            return
        mine = own(replicas, "local replicas", self.RULE)
        with torch.no_grad():
            for name, parameter in pl_module.named_parameters():
                parameter.copy_(mine["parameters"][name])
        trainer.optimizers[0].load_state_dict(mine["optimizer"])
        trainer.precision_plugin.load_state_dict(mine["precision"])


class ModelAveraging(LocalSGDCallback):
    """Average the parameters over all processes every `k_steps` optimizer steps after
    `begin_step` (torch `PeriodicModelAverager`); pair with `build_hook(begin_step)`."""

    def __init__(self, *, k_steps: int, begin_step: int) -> None:
        super().__init__(begin_step)
        self.k_steps = k_steps
        self.averager: Optional[PeriodicModelAverager] = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.averager is None and self.distributed(trainer):
            with warnings.catch_warnings():  # k_steps=1 (Fleet's default) is valid: average every step
                warnings.filterwarnings("ignore", message="When period is 1")
                self.averager = PeriodicModelAverager(period=self.k_steps,
                                                      warmup_steps=self.begin_step + self.k_steps - 1)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The averager holds the world process group: kept, it would keep the group's gloo threads
        # alive past destroy_process_group (runner/rank/train.py) until the trainer's reference cycle is
        # collected at interpreter exit, where a rank can abort ("terminate called without an
        # active exception"). The next fit makes a new one (its step is set at every call).
        self.averager = None

    @override
    def after_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                             step: int) -> bool:
        averager = self.averager
        averager.step = step - 1  # its own count (+1 per call), made to agree with the hook's
        # PeriodicModelAverager's schedule, to count what it does:
        since_warmup = averager.step - averager.warmup_steps
        averages = since_warmup >= 0 and since_warmup % averager.period == 0
        if averages:
            count_averaging(pl_module.parameters())
        averager.average_parameters(pl_module.parameters())
        return averages

