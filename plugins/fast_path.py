"""The fast path (`fast_path.*`, runner/config/fast_path.py) carried out. The plan holds each
piece as a claim `<- fast_path` (the compile also `<- collective`, for Fleet's op-fusion flags),
and runner/rank/build.py applies them with the rest of it:

- `compile_model`, the plan's last model transform: the model (or each pipeline stage) compiled
  in place with torch.compile;
- `fuse_optimizer`, an optimizer transform: the optimizer the model built, rebuilt with torch's
  fused step where torch has one for it and its parameters;
- `AttentionKernel`, a callback: the kernel of F.scaled_dot_product_attention for the whole run.
"""
from __future__ import annotations

import inspect
import sys
from contextlib import ExitStack
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_only
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from typing_extensions import override

from plugins.transforms import ModelContext

# The fused kernels torch's DTensor dispatches (torch/distributed/tensor/_ops/_pointwise_ops.py
# in torch 2.14 lists _fused_adam_ and _fused_adamw_); SGD's and Adagrad's raise
# NotImplementedError on DTensor parameters. tests/plugins/test_fast_path.py holds torch to it.
FUSED_ON_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


@rank_zero_only
def say(line: str) -> None:
    print(f"lightfleet: {line}", file=sys.stderr, flush=True)


def compile_model(part: nn.Module, context: ModelContext, mode: str) -> List[str]:
    """The plan's last model transform: compile `part` in place (nn.Module.compile), so the
    LightningModule's calls of itself run the compiled graph and DDP still wraps the same module
    object."""
    if context.strategy is None:  # the model alone, checked in the command (runner/rank/build.py): nothing to check
        return []
    part.compile(mode=mode)
    return [type(part).__name__]


def fuse_optimizer(optimizer: Optimizer) -> Optimizer:
    """`optimizer`'s class over its param groups (every key kept: lr, initial_lr, betas, ...) with
    torch's fused step. Built before any step through the class's own constructor, so that torch
    prepares what its fused step needs: `_step_supports_amp_scaling`, with which a GradScaler hands
    the step the scale and the overflow flag instead of unscaling the gradients first. Where
    torch has no fused kernel for the optimizer or its parameters: its foreach kernels, or as
    built, said in one line."""
    why_not = unfusable(optimizer)
    if why_not is None:
        groups = [{**group, "fused": True, "foreach": False} for group in optimizer.param_groups]
        fused = type(optimizer)(groups, **{**constructor_defaults(optimizer), "fused": True, "foreach": False})
        start_momentum_at_zero(fused)
        return fused
    instead = "its foreach implementation instead" if set_foreach(optimizer) else "stepped as built"
    say(f"fast_path.fused_optimizer: {type(optimizer).__name__} {why_not}; {instead}")
    return optimizer


def unfusable(optimizer: Optimizer) -> Optional[str]:
    """Why torch has no fused step for `optimizer` over its parameters; None when it has one."""
    if "fused" not in optimizer.defaults:
        return "has no fused implementation in torch"
    if isinstance(optimizer, torch.optim.SGD) and any(g["momentum"] and g["dampening"] for g in optimizer.param_groups):
        return "with dampening: torch's fused SGD starts its momentum wrongly after a skipped first step"
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not isinstance(optimizer, FUSED_ON_DTENSOR) and any(isinstance(param, DTensor) for param in params):
        return "has no fused kernel for DTensor parameters (sharding stages 2 and 3, tensor parallelism) in torch"
    devices = _get_fused_kernels_supported_devices()
    unsupported = sorted({f"{param.dtype} on {param.device.type}" for param in params
                          if param.device.type not in devices or not torch.is_floating_point(param)})
    return f"has no fused kernel for {', '.join(unsupported)} parameters" if unsupported else None


def start_momentum_at_zero(optimizer: Optimizer) -> None:
    """Momentum buffers of zeros for a fused SGD, before its first step. torch's fused SGD makes them
    at its first step with empty_like and fills them in its kernel, which a step skipped for an
    overflow (float16's loss scaling) never runs: they keep whatever the memory held, and every
    later step builds on it (ResNet-50 trained to NaN on an H200). From zeros, without dampening
    (`unfusable` keeps SGD with dampening as built), a first step's buffer is its gradient, as
    torch's other SGDs make it, and a skipped step leaves it at zero."""
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            for param in group["params"] if group["momentum"] else ():
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


def constructor_defaults(optimizer: Optimizer) -> Dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes (AdamW's takes no
    decoupled_weight_decay, which its defaults hold); its param groups carry the rest."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def set_foreach(optimizer: Optimizer) -> bool:
    """Switch `optimizer` to its foreach (multi-tensor) implementation, if it has one: torch's
    optimizers read `foreach` from the param groups at every step, so it can be set after
    construction. Whether it had one."""
    if "foreach" not in optimizer.defaults:
        return False
    optimizer.defaults["foreach"] = True
    for group in optimizer.param_groups:
        group["foreach"] = True
    return True


class AttentionKernel(pl.Callback):
    """The only kernel F.scaled_dot_product_attention may run in this rank, from setup (before
    the model is configured: the pipeline traces it, compile traces it) to teardown. torch keeps
    the choice in process-wide flags (torch.nn.attention.sdpa_kernel sets them), which every
    forward reads: the training and validation forwards, recompute's forwards again in backward
    (a context around the model's forward would be gone by then, and checkpoint refuses a
    recomputation whose saved tensors differ from the forward's), pipeline stages and sharded
    modules alike."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self._chosen = ExitStack()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._chosen.close()  # once per stage, however often setup comes
        self._chosen.enter_context(sdpa_kernel([KERNELS[self.kernel]]))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._chosen.close()
