"""Deep gradient compression (Fleet `strategy.dgc`, Paddle's DGCMomentumOptimizer; Lin et al.,
arXiv 1712.01887) as a DDP communication hook: each rank sends only the largest entries of its
momentum-corrected, locally accumulated gradient and keeps the rest for later steps.

What the runner's plan names: `build_hook` (the hook and its state), `replace_optimizer` (the
user's momentum SGD becomes plain SGD; momentum and weight decay move into the hook) and
`DGCCheckpoint` (every rank's hook state in Lightning checkpoints). The state lives in
plugins/dgc_state.py, the sparsity schedule and top-k selection in plugins/dgc_compression.py.
Details: docs/strategies.md#dgc
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from plugins import traffic
from plugins.dgc_compression import index_dtype, select
from plugins.dgc_state import OPTIMIZER_KEY, DGCState
from plugins.ranks import averaged, gather, own
from runner.core.contribution import NEEDED_OPTIMIZER
from runner.core.errors import ConfigError

NEEDS_MOMENTUM_SGD = f"dgc needs {NEEDED_OPTIMIZER['sgd_momentum']}"


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's averaged update (docs/strategies.md#dgc)."""
    if state.momentum is None:
        raise RuntimeError("dgc: the communication hook runs but plugins.dgc.replace_optimizer was not applied "
                           "to the model's optimizer (the momentum would be applied twice or not at all); "
                           "with plain DDP call state.configure(momentum=...)")
    bucket_state = state.bucket_state(bucket)
    step = state.step
    if bucket.is_last():  # DDP communicates buckets in index order; the last one ends the step
        state.step += 1
    buffer = bucket.buffer()
    group = state.group
    world_size = dist.get_world_size(group)
    momentum = state.momentum
    u, v = bucket_state.u, bucket_state.v

    grad = buffer.to(u.dtype)  # this rank's gradient (the buffer itself for float32)
    if bucket_state.weight_decay is not None:
        params = torch.cat([p.detach().reshape(-1) for p in bucket_state.params]).to(u.dtype)
        grad = grad.add(params.mul_(bucket_state.weight_decay))
    sparsity = state.sparsity_at(step)

    if sparsity is None:  # warm-up: dense allreduce, then momentum on the average (momentum SGD)
        grad = grad.div(world_size)
        traffic.count("all_reduce", grad, group)
        reduced = dist.all_reduce(grad, group=group, async_op=True).get_future()

        def apply_momentum(fut: torch.futures.Future) -> torch.Tensor:
            u.mul_(momentum).add_(fut.value()[0])
            return buffer.copy_(u)

        return reduced.then(apply_momentum)

    u.mul_(momentum).add_(grad)  # momentum correction
    v.add_(u)  # local accumulation
    indices = select(v, bucket_state.sizes, sparsity)
    values = v[indices]
    v.index_fill_(0, indices, 0)  # what was sent leaves the residual ...
    u.index_fill_(0, indices, 0)  # ... and the momentum (momentum factor masking)
    indices = indices.to(index_dtype(v.numel()))

    all_values = [torch.empty_like(values) for _ in range(world_size)]
    all_indices = [torch.empty_like(indices) for _ in range(world_size)]
    traffic.count("all_gather", values, group)
    traffic.count("all_gather", indices, group)
    gathers = [dist.all_gather(all_values, values, group=group, async_op=True).get_future(),
               dist.all_gather(all_indices, indices, group=group, async_op=True).get_future()]

    def decode(_: torch.futures.Future) -> torch.Tensor:
        dense = torch.zeros_like(v).index_add_(0, torch.cat(all_indices).long(), torch.cat(all_values))
        return buffer.copy_(dense.div_(world_size))

    return torch.futures.collect_all(gathers).then(decode)


def build_hook(*, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float]) -> Tuple[DGCState, Callable]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook`, over the default group.
    The knobs come checked by DGCConfig (runner/strategies/dgc.py) before any process starts."""
    return DGCState(rampup_begin_step, rampup_step, sparsity), dgc_hook


def _hook_state(trainer: Optional[pl.Trainer]) -> Optional[DGCState]:
    state = getattr(getattr(trainer, "strategy", None), "comm_hook_state", None)
    return state if isinstance(state, DGCState) else None


def replace_optimizer(optimizer: torch.optim.Optimizer, model: pl.LightningModule, **knobs: Any) -> torch.optim.SGD:
    """Plain SGD over the same param groups (lr, initial_lr, ... kept) for the user's momentum SGD,
    whose momentum and weight decay move into the DGC hook state (docs/strategies.md#dgc).

    Called by the build step once the DGC hook is registered (Lightning's DDPStrategy wraps the
    model and registers hooks before it calls `configure_optimizers`).
    """
    name = type(optimizer).__name__
    if type(optimizer) is not torch.optim.SGD:
        raise ConfigError(OPTIMIZER_KEY, name, NEEDS_MOMENTUM_SGD)
    groups = optimizer.param_groups
    momenta = {float(group["momentum"]) for group in groups}
    if not all(m > 0 for m in momenta):
        raise ConfigError(OPTIMIZER_KEY, name, NEEDS_MOMENTUM_SGD)
    if len(momenta) > 1:
        raise ConfigError(OPTIMIZER_KEY, f"SGD(momentum={sorted(momenta)})",
                          "dgc needs one momentum for all param groups")
    for option, allowed in (("nesterov", False), ("dampening", 0), ("maximize", False)):
        if any(group.get(option, allowed) != allowed for group in groups):
            raise ConfigError(OPTIMIZER_KEY, f"SGD({option}={next(g[option] for g in groups if g[option] != allowed)})",
                              f"dgc applies plain momentum in its communication hook; {option} is not supported")
    try:
        trainer = model.trainer
    except RuntimeError:
        trainer = None
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip:
        raise ConfigError("trainer.gradient_clip_val", clip,
                          "not with dgc: Lightning would clip the averaged sparse update, which carries the "
                          "momentum, not the gradient (Fleet clips each rank's gradient before compression)")
    state = _hook_state(trainer)
    if state is None:
        raise RuntimeError("dgc: no DGC communication hook is registered (trainer.strategy.comm_hook_state); "
                           "replace_optimizer needs plugins.ddp.build_ddp(comm_hook=plugins.dgc.build_hook)")
    weight_decay = {id(p): float(group["weight_decay"]) for group in groups for p in group["params"]}
    state.configure(momenta.pop(), list(model.named_parameters()), weight_decay)
    new_groups = [{**group, "params": list(group["params"]), "momentum": 0.0, "weight_decay": 0.0}
                  for group in groups]
    defaults = {**optimizer.defaults, "momentum": 0.0, "weight_decay": 0.0}
    return torch.optim.SGD(new_groups, **defaults)


class DGCCheckpoint(pl.Callback):
    """Saves every rank's DGC state (momentum, residuals, step) in Lightning checkpoints and
    restores it on `fit(ckpt_path=...)`.

    The residuals differ between ranks, and only rank 0 writes the checkpoint, so `state_dict()`
    gathers all ranks' states (Lightning builds the checkpoint on every rank). Lightning restores
    callbacks before the strategy wraps the model in DDP and creates the hook state, so the loaded
    state waits until `on_fit_start`.

    Resumed on another number of processes, every rank takes the mean of the old ranks' momentum
    and residual (the step is the same on all): the update not sent yet, averaged over the world,
    (1/N) sum_r v_r, stays what it was, and the momentum is that of the averaged gradient. A
    1-process checkpoint's state goes to every rank of a larger world alike.
    """

    RULE = averaged("every rank takes their mean, which keeps the update not sent yet, (1/N) sum_r v_r")

    def __init__(self) -> None:
        self._trainer: Optional[pl.Trainer] = None
        self._loaded: Optional[Dict[str, Any]] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def state_dict(self) -> Dict[str, Any]:
        state = _hook_state(self._trainer)
        if state is None:
            return dict(self._loaded or {})
        ranks = gather(state.state_dict(), state.group)
        return {"world_size": len(ranks), "ranks": ranks}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._loaded = state_dict or None  # applied in on_fit_start, once the hook state exists

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        self._apply()

    def _apply(self) -> None:
        state = _hook_state(self._trainer)
        if state is None or self._loaded is None:
            return
        state.load_state_dict(own(self._loaded["ranks"], "dgc residuals and momentum", self.RULE, state.group))
        self._loaded = None
