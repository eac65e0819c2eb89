"""LARS (Fleet `strategy.lars`, Paddle's `lars_momentum` op) as a torch optimizer.

Layer-wise Adaptive Rate Scaling, You, Gitman and Ginsburg, "Large Batch Training of
Convolutional Networks", arXiv:1708.03888. `replace_optimizer` turns the user's momentum SGD
into `LARS` with the same parameter groups, so learning-rate schedulers keep working on it.

The step loop, the weight-decay exclusion by parameter name and the grouping of tensors for
foreach ops come from plugins/layerwise.py, shared with plugins/lamb.py.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import nn
from typing_extensions import override

from plugins.layerwise import LayerwiseOptimizer, norm_dtype, replace_with
from runner.core.contribution import NEEDED_OPTIMIZER


class LARS(LayerwiseOptimizer):
    """Momentum SGD with a per-tensor ("layer-wise") learning rate, as Paddle's lars_momentum.

    For each parameter tensor w with gradient g, momentum buffer v (zeros at the start):

        local_lr = lr * lars_coeff * ||w|| / (||g|| + wd * ||w|| + epsilon)   if wd > 0, ||w|| > 0 and ||g|| > 0
                   lr                                                          otherwise
        v = momentum * v + local_lr * (g + wd * w)
        w = w - v

    with wd = `lars_weight_decay`, or 0 for the parameters flagged in the group's
    `no_weight_decay` list: as Paddle 3.3.1's lars_momentum kernel, a tensor without weight decay
    takes plain momentum SGD steps (tests/plugins/test_lars.py compares with Paddle). Norms are L2
    norms of whole tensors, and the update runs on foreach ops with nothing read back to the host: see LayerwiseOptimizer. The branch above
    is a `torch.where`. The state of a parameter is its `momentum_buffer`, so
    `state_dict()`/`load_state_dict()` round-trip as for torch's SGD. Other keys a group may
    carry (`dampening`, `nesterov`, `weight_decay` from an SGD it replaced) are kept and
    ignored: weight decay here is `lars_weight_decay`.
    """

    weight_decay_key = "lars_weight_decay"

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9, *, lars_coeff: float,
                 lars_weight_decay: float, epsilon: float) -> None:
        # The knobs come checked by LarsConfig (runner/strategies/lars.py), where their ranges live.
        for name, value in (("lr", lr), ("momentum", momentum)):
            if value < 0:
                raise ValueError(f"LARS: {name} must be >= 0, got {value}")
        super().__init__(params, dict(lr=lr, momentum=momentum, lars_coeff=lars_coeff,
                                      lars_weight_decay=lars_weight_decay, epsilon=epsilon))

    @override
    @staticmethod
    def _init_state(state: Dict[str, Any], param: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return (state["momentum_buffer"],)

    @override
    def _update_bucket(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                       states: List[List[torch.Tensor]], weight_decay: float) -> None:
        (buffers,) = states
        _lars_update(params, grads, buffers, lr=group["lr"], momentum=group["momentum"],
                     lars_coeff=group["lars_coeff"], weight_decay=weight_decay, epsilon=group["epsilon"])


def _lars_update(params: List[torch.Tensor], grads: List[torch.Tensor], buffers: List[torch.Tensor], *, lr: float,
                 momentum: float, lars_coeff: float, weight_decay: float, epsilon: float) -> None:
    """One LARS step for tensors of one device and dtype and one weight decay (see LARS)."""
    torch._foreach_mul_(buffers, momentum)
    if weight_decay > 0:  # v += local_lr * g + local_lr * wd * w, in place
        w_norms = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype(params)))
        g_norms = torch.stack(torch._foreach_norm(grads, 2, dtype=norm_dtype(params)))
        local_lrs = torch.where((w_norms > 0) & (g_norms > 0),
                                lr * lars_coeff * w_norms / (g_norms + weight_decay * w_norms + epsilon), lr).unbind()
        torch._foreach_addcmul_(buffers, grads, local_lrs)
        torch._foreach_addcmul_(buffers, params, local_lrs, value=weight_decay)
    else:  # Paddle's rule: no weight decay, no layer-wise rate (momentum SGD)
        torch._foreach_add_(buffers, grads, alpha=lr)
    torch._foreach_sub_(params, buffers)


def replace_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, *, lars_coeff: float,
                      lars_weight_decay: float, epsilon: float, exclude_from_weight_decay: Sequence[str]) -> LARS:
    """LARS over the parameter groups of the user's momentum SGD `optimizer`.

    Every group keeps all its keys (lr, initial_lr, momentum, ...) and gets `lars_coeff`,
    `lars_weight_decay`, `epsilon` and `no_weight_decay` (True for parameters whose name in
    `model` contains one of `exclude_from_weight_decay`). Raises ConfigError for anything but
    torch.optim.SGD with momentum > 0 in every group. The LARS state starts empty.
    """
    accepted = isinstance(optimizer, torch.optim.SGD) and not any(
        group["momentum"] <= 0 for group in optimizer.param_groups)
    return replace_with(LARS, optimizer, model, exclude_from_weight_decay, accepted=accepted,
                        requirement=f"lars needs {NEEDED_OPTIMIZER['sgd_momentum']}",
                        inherited=("lr", "momentum"), lars_coeff=lars_coeff, lars_weight_decay=lars_weight_decay,
                        epsilon=epsilon)
