"""Deep gradient compression (Fleet `strategy.dgc`, Paddle's DGCMomentumOptimizer; Lin et al.,
"Deep Gradient Compression", arXiv 1712.01887) as a DDP communication hook.

Per rank and per DDP bucket, with g the local gradient (weight decay folded in, see below):

    u = m * u + g            momentum correction: momentum is accumulated before compression
    v = v + u                local gradient accumulation
    send the top-k |v|       of each parameter: values and int32 indices (positions in the
                             bucket), k = ceil(numel * (1 - sparsity)) per parameter
    u[sent] = v[sent] = 0    momentum factor masking; what was not sent stays in v (the residual)

Selecting per parameter (as Paddle's dgc op does) keeps the result independent of how DDP groups
parameters into buckets (`bucket_cap_mb`, and the re-bucketing after the first iteration).
Unlike Fleet, small parameters are compressed too (Fleet sends those under 16384 entries dense).

The selected values and indices of every rank are exchanged with two `all_gather`s (works on
gloo and nccl), scatter-added into a dense tensor and divided by the world size: that average
becomes the gradient, and the optimizer (`replace_optimizer`) applies plain SGD to it - the
momentum lives in the hook now.

Warm-up (Fleet's schedule): before `rampup_begin_step` the hook allreduces densely and applies
the momentum to the average itself (u = m * u + mean(g)), which is exactly momentum SGD. From
step `rampup_begin_step + i` on it compresses with
`sparsity[min(len - 1, i * len // rampup_step)]`, so the list is walked over `rampup_step`
steps and its last value stays. The dense-phase momentum (the same on every rank) becomes each
rank's starting u.

Weight decay: Fleet adds the regularization to the gradient before DGC, so the decay is
compressed, accumulated and carried by the momentum like the rest of the gradient.
`replace_optimizer` therefore moves each param group's `weight_decay` into the hook (g += wd *
p, per parameter) and gives the replacement SGD weight_decay 0; without that, torch would add
wd * p after the communication, outside the momentum. Nesterov momentum, dampening and
`maximize` are refused (the hook implements heavy-ball momentum only), and so is Lightning's
gradient clipping, which would clip the momentum-carrying update the hook returns.

The hook state (momentum u, residual v, step) is kept per parameter name in `state_dict()`, so
it survives DDP rebuilding its buckets after the first iteration and a restart;
`DGCCheckpoint` stores every rank's state in Lightning checkpoints. The state assumes unscaled
gradients: float16 loss scaling would accumulate scaled (and possibly inf) values in it.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from runner.errors import ConfigError

OPTIMIZER_KEY = "model.optimizer"
NEEDS_MOMENTUM_SGD = "dgc needs momentum SGD (torch.optim.SGD with momentum > 0)"


def sparsity_at(step: int, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float]) -> Optional[float]:
    """The sparsity DGC uses at optimizer step `step` (0-based), or None before
    `rampup_begin_step` (dense allreduce). Paddle's `get_period_sparcity`."""
    if step < rampup_begin_step:
        return None
    index = (step - rampup_begin_step) * len(sparsity) // rampup_step
    return float(sparsity[min(len(sparsity) - 1, index)])


def top_k(numel: int, sparsity: float) -> int:
    """How many of `numel` entries are sent at `sparsity`: ceil(numel * (1 - sparsity)), at least 1."""
    # Rounded first so that float error (1 - 0.999 = 0.0010000000000000009) cannot add one.
    return min(numel, max(1, math.ceil(round(numel * (1.0 - sparsity), 6))))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def message_bytes(sizes: Sequence[int], sparsity: float, value_bytes: int = 4) -> int:
    """Bytes one rank sends for a bucket of parameters of `sizes` entries: per parameter its top-k
    values plus as many indices (int32 unless the bucket needs int64 positions)."""
    k = sum(top_k(size, sparsity) for size in sizes)
    return k * (value_bytes + index_dtype(sum(sizes)).itemsize)


def select(accumulated: torch.Tensor, sizes: Sequence[int], sparsity: float) -> torch.Tensor:
    """Positions in the bucket of the top-k |accumulated| entries of each parameter (one `topk` per
    parameter, whose entries lie at consecutive offsets)."""
    magnitude = accumulated.abs()
    picked, offset = [], 0
    for size in sizes:
        top = magnitude.narrow(0, offset, size).topk(top_k(size, sparsity), sorted=False).indices
        picked.append(top.add_(offset))
        offset += size
    return torch.cat(picked)


class _BucketState:
    """Flat momentum and residual for one DDP bucket, laid out like its gradient buffer."""

    def __init__(self, params: List[torch.Tensor], names: List[str], u: torch.Tensor, v: torch.Tensor,
                 weight_decay: Optional[torch.Tensor | float]) -> None:
        self.params = params
        self.names = names
        self.sizes = [p.numel() for p in params]
        self.u = u  # momentum
        self.v = v  # accumulated gradient not sent yet (the residual)
        self.weight_decay = weight_decay  # None, one float, or a per-entry tensor

    def same_layout(self, params: Sequence[torch.Tensor]) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def pieces(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        return dict(zip(self.names, zip(self.u.split(self.sizes), self.v.split(self.sizes))))


class DGCState:
    """Everything the hook keeps between steps; `trainer.strategy.comm_hook_state` in a run.

    `replace_optimizer` calls `configure` (momentum, parameter names, per-parameter weight decay)
    before the first backward; used with plain DDP, call it yourself. `trace`, when set to a list, receives one dict per bucket and
    step (CPU copies of the vectors involved; for tests and inspection).
    """

    def __init__(self, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float],
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.rampup_begin_step = rampup_begin_step
        self.rampup_step = rampup_step
        self.sparsity = [float(s) for s in sparsity]
        self.process_group = process_group
        self.momentum: Optional[float] = None
        self.names: Dict[int, str] = {}  # id(parameter) -> name
        self.weight_decay: Dict[int, float] = {}  # id(parameter) -> weight decay
        self.step = 0  # optimizer steps communicated so far
        self.buckets: Dict[int, _BucketState] = {}  # by bucket index
        # Per-parameter (momentum, residual) not placed in a bucket yet: loaded from a checkpoint,
        # or left by buckets that DDP rebuilt.
        self.loose: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.sent_bytes = 0  # bytes this rank sent in compressed steps (values + indices) ...
        self.dense_bytes = 0  # ... and what a dense allreduce of the same buckets would have sent
        self.trace: Optional[List[Dict[str, Any]]] = None

    def sparsity_at(self, step: int) -> Optional[float]:
        return sparsity_at(step, self.rampup_begin_step, self.rampup_step, self.sparsity)

    def configure(self, momentum: float, named_parameters: Sequence[Tuple[str, torch.Tensor]] = (),
                  weight_decay: Optional[Dict[int, float]] = None) -> None:
        """The momentum, parameter names (keys of `state_dict()`) and weight decay by id(parameter)."""
        if self.momentum is not None and momentum != self.momentum:
            raise ConfigError(OPTIMIZER_KEY, f"SGD(momentum={momentum})",
                              f"dgc keeps one momentum; another optimizer already uses {self.momentum}")
        self.momentum = float(momentum)
        self.names.update({id(p): name for name, p in named_parameters})
        self.weight_decay.update(weight_decay or {})

    # ------------------------------------------------------------------ bucket layout

    def bucket_state(self, bucket: dist.GradBucket) -> _BucketState:
        """The bucket's state, (re)assembled from per-parameter pieces when its layout is new."""
        params = bucket.parameters()
        state = self.buckets.get(bucket.index())
        if state is not None and state.same_layout(params):
            return state
        # Parameters are named by replace_optimizer (the LightningModule's names, which checkpoints
        # use); a model it has not seen (plain DDP) gets names by first appearance.
        names = [self.names.setdefault(id(p), f"<parameter {len(self.names)}>") for p in params]
        held = {name for old in self.buckets.values() for name in old.names}
        if state is not None or not held.isdisjoint(names):
            # DDP rebuilt its buckets (after the first iteration): regroup all state by parameter.
            for old in self.buckets.values():
                self.loose.update(old.pieces())
            self.buckets.clear()
        buffer = bucket.buffer()
        sizes = [p.numel() for p in params]
        if sum(sizes) != buffer.numel():
            raise RuntimeError(f"dgc: bucket {bucket.index()} holds {buffer.numel()} gradient entries but its "
                               f"parameters {sum(sizes)}")
        dtype = torch.promote_types(buffer.dtype, torch.float32)  # keep the residual in >= float32

        def piece(name: str, size: int, which: int) -> torch.Tensor:
            loaded = self.loose.get(name)
            if loaded is None:
                return torch.zeros(size, dtype=dtype, device=buffer.device)
            return loaded[which].reshape(-1).to(device=buffer.device, dtype=dtype)

        u = torch.cat([piece(n, s, 0) for n, s in zip(names, sizes)])
        v = torch.cat([piece(n, s, 1) for n, s in zip(names, sizes)])
        for name in names:
            self.loose.pop(name, None)
        decays = [self.weight_decay.get(id(p), 0.0) for p in params]
        if not any(decays):
            weight_decay = None
        elif len(set(decays)) == 1:
            weight_decay = decays[0]
        else:
            weight_decay = torch.tensor(decays, dtype=dtype, device=buffer.device).repeat_interleave(
                torch.tensor(sizes, device=buffer.device))
        state = _BucketState(list(params), names, u, v, weight_decay)
        self.buckets[bucket.index()] = state
        return state

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> Dict[str, Any]:
        """This rank's step, momentum and residual, per parameter name (CPU copies)."""
        pieces = dict(self.loose)
        for state in self.buckets.values():
            pieces.update(state.pieces())
        buffers = {name: {"momentum": u.detach().cpu().clone(), "residual": v.detach().cpu().clone()}
                   for name, (u, v) in pieces.items()}
        return {"step": self.step, "buffers": buffers}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.buckets.clear()
        self.loose = {name: (entry["momentum"], entry["residual"]) for name, entry in state_dict["buffers"].items()}
        unknown = sorted(set(self.loose) - set(self.names.values())) if self.names else []
        if unknown:
            rank_zero_warn(f"dgc: checkpoint holds state for parameters the model does not have: {unknown[:5]}")


def _record(state: DGCState, **entry: Any) -> None:
    state.trace.append({key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                        for key, value in entry.items()})


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's averaged update (see the module docstring)."""
    if state.momentum is None:
        raise RuntimeError("dgc: the communication hook runs but plugins.dgc.replace_optimizer was not applied "
                           "to the model's optimizer (the momentum would be applied twice or not at all); "
                           "with plain DDP call state.configure(momentum=...)")
    bucket_state = state.bucket_state(bucket)
    step = state.step
    if bucket.is_last():  # DDP communicates buckets in index order; the last one ends the step
        state.step += 1
    buffer = bucket.buffer()
    group = state.process_group if state.process_group is not None else dist.group.WORLD
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
        reduced = dist.all_reduce(grad, group=group, async_op=True).get_future()

        def apply_momentum(fut: torch.futures.Future) -> torch.Tensor:
            average = fut.value()[0]
            u.mul_(momentum).add_(average)
            if state.trace is not None:
                _record(state, step=step, bucket=bucket.index(), names=bucket_state.names, sparsity=None,
                        average=average, momentum=u)
            return buffer.copy_(u)

        return reduced.then(apply_momentum)

    u.mul_(momentum).add_(grad)  # momentum correction
    v.add_(u)  # local accumulation
    indices = select(v, bucket_state.sizes, sparsity)
    values = v[indices]
    if state.trace is not None:
        _record(state, step=step, bucket=bucket.index(), names=bucket_state.names, sparsity=sparsity, grad=grad,
                accumulated=v, values=values, indices=indices)
    v.index_fill_(0, indices, 0)  # what was sent leaves the residual ...
    u.index_fill_(0, indices, 0)  # ... and the momentum (momentum factor masking)
    indices = indices.to(index_dtype(v.numel()))
    sent_bytes = values.numel() * values.element_size() + indices.numel() * indices.element_size()
    dense_bytes = buffer.numel() * buffer.element_size()
    state.sent_bytes += sent_bytes
    state.dense_bytes += dense_bytes
    if state.trace is not None:
        state.trace[-1].update(residual=v.cpu().clone(), momentum=u.cpu().clone(), sent_bytes=sent_bytes,
                               dense_bytes=dense_bytes)

    all_values = [torch.empty_like(values) for _ in range(world_size)]
    all_indices = [torch.empty_like(indices) for _ in range(world_size)]
    gathers = [dist.all_gather(all_values, values, group=group, async_op=True).get_future(),
               dist.all_gather(all_indices, indices, group=group, async_op=True).get_future()]

    def decode(_: torch.futures.Future) -> torch.Tensor:
        dense = torch.zeros_like(v).index_add_(0, torch.cat(all_indices).long(), torch.cat(all_values))
        return buffer.copy_(dense.div_(world_size))

    return torch.futures.collect_all(gathers).then(decode)


def build_hook(rampup_begin_step: int = 0, rampup_step: int = 1,
               sparsity: Sequence[float] = (0.999,)) -> Tuple[DGCState, Callable]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook`, over the default group.
    The knobs are checked by the schema (runner.schema.DGCConfig) before any process starts."""
    return DGCState(rampup_begin_step, rampup_step, sparsity), dgc_hook


def _hook_state(trainer: Optional[pl.Trainer]) -> Optional[DGCState]:
    state = getattr(getattr(trainer, "strategy", None), "comm_hook_state", None)
    return state if isinstance(state, DGCState) else None


def replace_optimizer(optimizer: torch.optim.Optimizer, model: pl.LightningModule, **knobs: Any) -> torch.optim.SGD:
    """Plain SGD over the same param groups (lr, initial_lr, ... kept) for the user's momentum SGD,
    whose momentum and weight decay move into the DGC hook state (see the module docstring).

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
    state waits until `on_fit_start`. Resuming on another world size keeps only the step.
    """

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
        mine = state.state_dict()
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            ranks: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, mine, group=group)
        else:
            ranks = [mine]
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
        ranks = self._loaded["ranks"]
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(group) if distributed else 1
        if len(ranks) == world_size:
            state.load_state_dict(ranks[dist.get_rank(group) if distributed else 0])
        else:
            rank_zero_warn(f"dgc: the checkpoint holds the state of {len(ranks)} ranks, this run has {world_size}: "
                           "residuals and momentum start from zero")
            state.load_state_dict({"step": ranks[0]["step"], "buffers": {}})
        self._loaded = None
