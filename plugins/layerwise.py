"""What the layer-wise adaptive optimizers (plugins/lars.py: LARS, plugins/lamb.py: LAMB) share.

Both scale each tensor's update by a trust ratio of whole-tensor norms on `torch._foreach_*`
ops, exclude parameters from weight decay by name, and replace the user's optimizer. Here:

- `LayerwiseOptimizer`: the base class. It checks each group's `no_weight_decay` flags, and its
  `step` evaluates the closure and walks the groups' buckets (`grad_buckets`), handing each to
  the subclass's `_update_bucket` with the weight decay that applies to it.
- `grad_buckets` and `CPU_CHUNK_NUMEL`: the grouping of tensors for foreach ops; `norm_dtype`.
- `NO_WEIGHT_DECAY`, `no_weight_decay_flags`, `check_no_weight_decay_flags`: the exclusion.
- `copy_groups` and `replace_with`: the replacement of the user's optimizer, keeping its groups
  so that learning-rate schedulers keep working on the replacement.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar

import torch
from torch import nn
from typing_extensions import override

from runner.core.errors import ConfigError

# Per-group key holding one bool per parameter of the group: True = no weight decay for it.
NO_WEIGHT_DECAY = "no_weight_decay"


class LayerwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step is a foreach update per bucket of tensors (`grad_buckets`).

    Parameters flagged in their group's `no_weight_decay` list (one bool per parameter;
    `replace_optimizer` fills it from names) get no weight decay. Norms are L2 norms of whole
    tensors: the trust ratio is a property of a full layer, so a sharded optimizer must
    all-reduce the squared norms of its shards before using them. The update runs on
    `torch._foreach_*` ops over the tensors of each group (per device, dtype and weight decay
    on/off; in chunks on the CPU), branches are `torch.where`, and nothing is read back to the
    host. Parameters without a gradient are left alone.

    Subclasses name their group key for weight decay in `weight_decay_key` and implement
    `_init_state(state, param)` (create the parameter's state if missing; return its tensors
    that the update takes, in order) and `_update_bucket(group, params, grads, states,
    weight_decay)` (`states`: one list per tensor `_init_state` returns; `weight_decay`: the
    group's, or 0.0 for a bucket of parameters flagged in its `no_weight_decay` list).
    Every group gets a `no_weight_decay` key (default None: no parameter excluded).
    """

    weight_decay_key: ClassVar[str]

    def __init__(self, params: Iterable[Any], defaults: Dict[str, Any]) -> None:
        super().__init__(params, {**defaults, NO_WEIGHT_DECAY: None})

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
            for params, grads, *states, decays in grad_buckets(self, group, self._init_state):
                self._update_bucket(group, params, grads, states,
                                    weight_decay=group[self.weight_decay_key] if decays else 0.0)
        return loss

    @staticmethod
    def _init_state(state: Dict[str, Any], param: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _update_bucket(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                       states: List[List[torch.Tensor]], weight_decay: float) -> None:
        raise NotImplementedError


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


Layerwise = TypeVar("Layerwise", bound=LayerwiseOptimizer)


def replace_with(cls: Type[Layerwise], optimizer: torch.optim.Optimizer, model: nn.Module,
                 exclude_from_weight_decay: Sequence[str], *, accepted: bool, requirement: str,
                 inherited: Sequence[str], **knobs: Any) -> Layerwise:
    """`cls` over `copy_groups(optimizer, model, exclude_from_weight_decay, **knobs)`, with
    defaults `knobs` and the `inherited` keys of the optimizer's defaults. Raises ConfigError
    ("model.optimizer", the optimizer's class name, `requirement`) unless `accepted`."""
    if not accepted:
        raise ConfigError("model.optimizer", type(optimizer).__name__, requirement)
    groups = copy_groups(optimizer, model, exclude_from_weight_decay, **knobs)
    return cls(groups, **{key: optimizer.defaults[key] for key in inherited}, **knobs)
