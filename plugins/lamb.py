"""LAMB (Fleet `strategy.lamb`, Paddle's `lamb` op) as a torch optimizer.

Layer-wise Adaptive Moments for Batch training, You et al., "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", arXiv:1904.00962. `replace_optimizer` turns the user's
Adam or AdamW into `LAMB` with the same parameter groups (betas and eps included), so
learning-rate schedulers keep working on it.

The step loop, the weight-decay exclusion by parameter name and the grouping of tensors for
foreach ops come from plugins/layerwise.py, shared with plugins/lars.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import nn
from typing_extensions import override

from plugins.layerwise import LayerwiseOptimizer, norm_dtype, replace_with
from runner.core.contribution import NEEDED_OPTIMIZER


class LAMB(LayerwiseOptimizer):
    """Adam moments with a per-tensor ("layer-wise") trust ratio, as Paddle's lamb op.

    For each parameter tensor w with gradient g, at its step t = 1, 2, ... (moments m, v start
    at zero):

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g^2
        r = m_hat / (sqrt(v_hat) + eps) + wd * w,   m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)
        trust = ||w|| / ||r||   if (wd > 0 or always_adapt), ||w|| > 0 and ||r|| > 0,   else 1
        w = w - lr * trust * r

    with wd = `lamb_weight_decay`, or 0 for the parameters flagged in the group's
    `no_weight_decay` list: as Paddle 3.3.1's lamb kernel with `always_adapt=False` (Fleet's), a
    tensor without weight decay takes the plain Adam-style step r (tests/plugins/test_lamb.py
    compares with Paddle). Norms are L2 norms of whole tensors, and the update runs on
    foreach ops with nothing read back to the host (see LayerwiseOptimizer): the branch above
    is a `torch.where`, and the step count is a tensor on the parameter's device. The state of
    a parameter is `step`, `exp_avg` (m) and `exp_avg_sq` (v), torch's Adam names, so
    `state_dict()` and `load_state_dict()` round-trip. Other keys a group may carry
    (`weight_decay`, `amsgrad`, ... from an Adam it replaced) are kept and ignored: weight
    decay here is `lamb_weight_decay`.
    """

    weight_decay_key = "lamb_weight_decay"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, *, lamb_weight_decay: float, always_adapt: bool) -> None:
        # lamb_weight_decay comes checked by LambConfig (runner/strategies/lamb.py), where its range lives.
        if lr < 0 or eps < 0:
            raise ValueError(f"LAMB: lr and eps must be >= 0, got {lr}, {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"LAMB: betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, lamb_weight_decay=lamb_weight_decay,
                                      always_adapt=always_adapt))

    @override
    @staticmethod
    def _init_state(state: Dict[str, Any], param: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device:
            # load_state_dict leaves `step` where it was saved (torch's rule for non-capturable
            # optimizers); here it takes part in device-side arithmetic, so it follows the param.
            state["step"] = state["step"].to(param.device)
        return state["step"], state["exp_avg"], state["exp_avg_sq"]

    @override
    def _update_bucket(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                       states: List[List[torch.Tensor]], weight_decay: float) -> None:
        steps, exp_avgs, exp_avg_sqs = states
        beta1, beta2 = group["betas"]
        _lamb_update(params, grads, steps, exp_avgs, exp_avg_sqs, lr=group["lr"], beta1=beta1, beta2=beta2,
                     eps=group["eps"], weight_decay=weight_decay, adapt=weight_decay > 0 or group["always_adapt"])


def bias_correction(step: torch.Tensor, beta: float) -> torch.Tensor:
    """1 - beta**step, exactly: -expm1(step * log(beta)) (beta = 0: 1)."""
    return -torch.expm1(step * (math.log(beta) if beta > 0 else -math.inf))


def _lamb_update(params: List[torch.Tensor], grads: List[torch.Tensor], steps: List[torch.Tensor],
                 exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor], *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, adapt: bool) -> None:
    """One LAMB step for tensors of one device and dtype and one weight decay (see LAMB);
    `adapt`: scale by the trust ratio."""
    torch._foreach_add_(steps, 1)
    # Per-tensor scalars on the device, computed once for the whole list: bc = 1 - beta^t, in
    # float64 as -expm1(t log beta): in float32, 1 - 0.999^t loses about 1e-5 of its value.
    step = torch.stack(steps).double()
    bias_correction1 = bias_correction(step, beta1)
    bias_correction2_sqrt = bias_correction(step, beta2).sqrt()
    dtype = exp_avgs[0].dtype
    eps_terms = (eps * bias_correction2_sqrt).to(dtype).unbind()
    scales = (bias_correction2_sqrt / bias_correction1).to(dtype).unbind()

    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)

    # r = m_hat / (sqrt(v_hat) + eps) = (m / (sqrt(v) + eps * sqrt(bc2))) * sqrt(bc2) / bc1
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, eps_terms)
    updates = torch._foreach_div(exp_avgs, denominators)
    del denominators
    torch._foreach_mul_(updates, scales)
    if weight_decay != 0:
        torch._foreach_add_(updates, params, alpha=weight_decay)

    if not adapt:
        torch._foreach_add_(params, updates, alpha=-lr)
        return
    w_norms = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype(params)))
    r_norms = torch.stack(torch._foreach_norm(updates, 2, dtype=norm_dtype(params)))
    trust = torch.where((w_norms > 0) & (r_norms > 0), w_norms / r_norms, 1.0)
    torch._foreach_addcmul_(params, updates, (trust * -lr).unbind())


def replace_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, *, lamb_weight_decay: float,
                      exclude_from_weight_decay: Sequence[str], always_adapt: bool) -> LAMB:
    """LAMB over the parameter groups of the user's Adam or AdamW `optimizer`.

    Every group keeps all its keys (lr, initial_lr, betas, eps, ...) and gets
    `lamb_weight_decay`, `always_adapt` and `no_weight_decay` (True for parameters whose name in `model`
    contains one of `exclude_from_weight_decay`). Raises ConfigError for any other optimizer.
    The LAMB state starts empty.
    """
    return replace_with(LAMB, optimizer, model, exclude_from_weight_decay,
                        accepted=isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)),
                        requirement=f"lamb needs {NEEDED_OPTIMIZER['adam']}",
                        inherited=("lr", "betas", "eps"), lamb_weight_decay=lamb_weight_decay,
                        always_adapt=always_adapt)
