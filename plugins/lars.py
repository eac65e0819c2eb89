"""LARS (Fleet `strategy.lars`, Paddle's `lars_momentum` op) as a torch optimizer.

Layer-wise Adaptive Rate Scaling, You, Gitman and Ginsburg, "Large Batch Training of
Convolutional Networks", arXiv:1708.03888. `replace_optimizer` turns the user's momentum SGD
into `LARS` with the same parameter groups, so learning-rate schedulers keep working on it.

The weight-decay exclusion by parameter name (`no_weight_decay_flags`, `copy_groups`) and the
grouping of tensors for foreach ops (`grad_buckets`) are shared with plugins/lamb.py.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from typing_extensions import override

from runner.errors import ConfigError

# Per-group key holding one bool per parameter of the group: True = no weight decay for it.
NO_WEIGHT_DECAY = "no_weight_decay"


class LARS(torch.optim.Optimizer):
    """Momentum SGD with a per-tensor ("layer-wise") learning rate, as Paddle's lars_momentum.

    For each parameter tensor w with gradient g, momentum buffer v (zeros at the start):

        local_lr = lr * lars_coeff * ||w|| / (||g|| + wd * ||w|| + epsilon)   if ||w|| > 0 and ||g|| > 0
                   lr                                                          otherwise
        v = momentum * v + local_lr * (g + wd * w)
        w = w - v

    with wd = `lars_weight_decay`, or 0 for the parameters flagged in the group's
    `no_weight_decay` list (one bool per parameter; `replace_optimizer` fills it from names).
    Norms are L2 norms of whole tensors: the trust ratio is a property of a full layer, so a
    sharded optimizer must all-reduce the squared norms of its shards before using them.

    The update runs on `torch._foreach_*` ops over the tensors of each group (per device, dtype
    and weight decay on/off; in chunks on the CPU), the branch above is a `torch.where`, and
    nothing is read back to the host. The state of a parameter is its `momentum_buffer`, so
    `state_dict()`/`load_state_dict()` round-trip as for torch's SGD. Parameters without a
    gradient are left alone. Other keys a group may carry (`dampening`, `nesterov`,
    `weight_decay` from an SGD it replaced) are kept and ignored: weight decay here is
    `lars_weight_decay`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        lars_coeff: float = 0.001,
        lars_weight_decay: float = 0.0005,
        epsilon: float = 0.0,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("lars_coeff", lars_coeff),
                            ("lars_weight_decay", lars_weight_decay), ("epsilon", epsilon)):
            if value < 0:
                raise ValueError(f"LARS: {name} must be >= 0, got {value}")
        defaults = dict(lr=lr, momentum=momentum, lars_coeff=lars_coeff, lars_weight_decay=lars_weight_decay,
                        epsilon=epsilon, **{NO_WEIGHT_DECAY: None})
        super().__init__(params, defaults)

    @override
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_no_weight_decay_flags(self.param_groups[-1])

    @override
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for params, grads, buffers, decays in grad_buckets(self, group, self._init_state):
                _lars_update(params, grads, buffers, lr=group["lr"], momentum=group["momentum"],
                             lars_coeff=group["lars_coeff"], weight_decay=group["lars_weight_decay"] if decays else 0.0,
                             epsilon=group["epsilon"])
        return loss

    @staticmethod
    def _init_state(state: Dict[str, Any], param: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return (state["momentum_buffer"],)


def _lars_update(params: List[torch.Tensor], grads: List[torch.Tensor], buffers: List[torch.Tensor], *, lr: float,
                 momentum: float, lars_coeff: float, weight_decay: float, epsilon: float) -> None:
    """One LARS step for tensors of one device and dtype and one weight decay (see LARS)."""
    w_norms = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype(params)))
    g_norms = torch.stack(torch._foreach_norm(grads, 2, dtype=norm_dtype(params)))
    local_lr = torch.where((w_norms > 0) & (g_norms > 0),
                           lr * lars_coeff * w_norms / (g_norms + weight_decay * w_norms + epsilon), lr)
    local_lrs = local_lr.unbind()
    # v = momentum * v + local_lr * g + local_lr * wd * w, in place
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_addcmul_(buffers, grads, local_lrs)
    if weight_decay != 0:
        torch._foreach_addcmul_(buffers, params, local_lrs, value=weight_decay)
    torch._foreach_sub_(params, buffers)


def norm_dtype(tensors: List[torch.Tensor]) -> Optional[torch.dtype]:
    """float32 norms for 16-bit tensors (their squares' sum overflows easily), else their own."""
    return torch.float32 if tensors[0].dtype in (torch.float16, torch.bfloat16) else None


def check_no_weight_decay_flags(group: Dict[str, Any]) -> None:
    flags = group.get(NO_WEIGHT_DECAY)
    if flags is not None and len(flags) != len(group["params"]):
        raise ValueError(f"param group key {NO_WEIGHT_DECAY!r} needs one bool per parameter: "
                         f"{len(flags)} for {len(group['params'])} parameters")


# On the CPU a foreach op allocates its outputs for the whole list at once: for ResNet-50 that is
# 100 MB, fresh from the OS (page faults) at every step, where a loop reuses each freed
# temporary. Lists on the CPU are cut into chunks of about this many elements (16 MiB in
# float32), whose temporaries the allocator does reuse. Other devices get whole lists.
CPU_CHUNK_NUMEL = 1 << 22


def grad_buckets(optimizer: torch.optim.Optimizer, group: Dict[str, Any],
                 init_state: Callable[[Dict[str, Any], torch.Tensor], Tuple[Any, ...]]) -> Iterable[Tuple[Any, ...]]:
    """The group's parameters that have a gradient, as lists for foreach ops: one bucket per
    device, dtype and weight decay on/off (so the arithmetic inside takes plain scalars), and
    on the CPU chunks of about CPU_CHUNK_NUMEL elements. Yields (params, grads, *state lists
    from `init_state(state, param)`, decays: bool)."""
    flags = group.get(NO_WEIGHT_DECAY) or [False] * len(group["params"])
    buckets: Dict[Tuple[torch.device, torch.dtype, bool], List[tuple]] = defaultdict(list)
    for param, excluded in zip(group["params"], flags):
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
        extra = init_state(optimizer.state[param], param)
        buckets[(param.device, param.dtype, not excluded)].append((param, param.grad, *extra))
    for (device, _, decays), rows in buckets.items():
        limit = CPU_CHUNK_NUMEL if device.type == "cpu" else None
        chunk: List[tuple] = []
        size = 0
        for row in rows:
            chunk.append(row)
            size += row[0].numel()
            if limit is not None and size >= limit:
                yield (*(list(column) for column in zip(*chunk)), decays)
                chunk, size = [], 0
        if chunk:
            yield (*(list(column) for column in zip(*chunk)), decays)


def no_weight_decay_flags(params: Sequence[torch.Tensor], model: nn.Module, patterns: Sequence[str]) -> List[bool]:
    """For each of `params`: does one of its names in `model` contain one of `patterns`?

    Names come from `model.named_parameters()` (all names of a shared parameter count; a block
    wrapped by recompute shows a `_checkpoint_wrapped_module.` segment, which substrings skip).
    A parameter the model does not hold is never excluded.
    """
    names: Dict[int, List[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return [any(pattern in name for pattern in patterns for name in names[id(param)]) for param in params]


def copy_groups(optimizer: torch.optim.Optimizer, model: nn.Module, exclude_from_weight_decay: Sequence[str],
                **keys: Any) -> List[Dict[str, Any]]:
    """The optimizer's param groups copied with every key kept, plus `keys` and the
    `no_weight_decay` flags: one group per original group, so LR schedulers built on the
    original optimizer line up with the replacement's groups."""
    groups = []
    for group in optimizer.param_groups:
        params = list(group["params"])
        groups.append({**group, "params": params, **keys,
                       NO_WEIGHT_DECAY: no_weight_decay_flags(params, model, list(exclude_from_weight_decay))})
    return groups


def replace_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    lars_coeff: float = 0.001,
    lars_weight_decay: float = 0.0005,
    epsilon: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
) -> LARS:
    """LARS over the parameter groups of the user's momentum SGD `optimizer`.

    Every group keeps all its keys (lr, initial_lr, momentum, ...) and gets `lars_coeff`,
    `lars_weight_decay`, `epsilon` and `no_weight_decay` (True for parameters whose name in
    `model` contains one of `exclude_from_weight_decay`). Raises ConfigError for anything but
    torch.optim.SGD with momentum > 0 in every group. The LARS state starts empty.
    """
    if not isinstance(optimizer, torch.optim.SGD) or any(group["momentum"] <= 0 for group in optimizer.param_groups):
        raise ConfigError("model.optimizer", type(optimizer).__name__,
                          "lars needs momentum SGD (torch.optim.SGD with momentum > 0)")
    groups = copy_groups(optimizer, model, exclude_from_weight_decay, lars_coeff=lars_coeff,
                         lars_weight_decay=lars_weight_decay, epsilon=epsilon)
    return LARS(groups, lr=optimizer.defaults["lr"], momentum=optimizer.defaults["momentum"], lars_coeff=lars_coeff,
                lars_weight_decay=lars_weight_decay, epsilon=epsilon)
