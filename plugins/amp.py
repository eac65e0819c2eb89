"""Automatic mixed precision (Fleet `strategy.amp`) on Lightning's `MixedPrecision` plugin.

float16 runs under `torch.autocast` with `FleetGradScaler`, a `torch.amp.GradScaler` whose
scale follows Fleet's dynamic loss scaling rule instead of torch's; bfloat16 needs no loss
scaling. Fleet's custom white/black lists become per-module forward overrides: a listed
module's forward runs with autocast off and everything in float16/bfloat16 (white) or
float32 (black).
"""
from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.utilities import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from plugins.modules import child_name, float_buffer_modules, match_modules
from plugins.transforms import ModelContext
from runner.core.errors import ConfigError


class FleetGradScaler(torch.amp.GradScaler):
    """Loss scaler with Fleet's rule (Paddle's `update_loss_scaling` op).

    After each optimizer step: on overflow (inf/nan gradients, the step is skipped)
    good_steps = 0 and bad_steps += 1, and when bad_steps reaches `decr_every_n_nan_or_inf`
    the scale becomes max(scale * decr_ratio, 1) and bad_steps 0; on a good step bad_steps = 0
    and good_steps += 1, and when good_steps reaches `incr_every_n_steps` the scale is
    multiplied by `incr_ratio` if that stays finite, and good_steps becomes 0. torch's own rule
    differs: it backs off on every overflow, without a floor. With
    `use_dynamic_loss_scaling=False` the scale stays at `init_loss_scaling`.

    In a process group of more than one rank, the overflow flag is all-reduced (max) at
    unscaling, so every rank skips the same steps and keeps the same scale: a rank holding
    only a shard of the gradients (sharding) or of the model (pipeline) may be the only one
    to see an inf, and a sharded optimizer's step is itself a collective. Sharded (DTensor)
    gradients are unscaled by torch's own foreach kernel, which DTensor supports.

    Fleet's knobs are kept in the base class's fields (init_loss_scaling = init_scale,
    incr_ratio = growth_factor, decr_ratio = backoff_factor, incr_every_n_steps =
    growth_interval, good_steps = the growth tracker), so `state_dict()` holds torch's keys
    plus `bad_steps`, `decr_every_n_nan_or_inf` and `use_dynamic_loss_scaling`.
    """

    def __init__(
        self,
        device: str,
        init_loss_scaling: float,
        use_dynamic_loss_scaling: bool,
        incr_every_n_steps: int,
        decr_every_n_nan_or_inf: int,
        incr_ratio: float,
        decr_ratio: float,
    ) -> None:
        super().__init__(device, init_scale=init_loss_scaling, growth_factor=incr_ratio,
                         backoff_factor=decr_ratio, growth_interval=incr_every_n_steps)
        self._use_dynamic_loss_scaling = use_dynamic_loss_scaling
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        # Like the scale and the growth tracker, created on the loss's device at the first scale().
        self._init_bad_steps = 0
        self._bad_steps: Optional[torch.Tensor] = None

    @override
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._bad_steps = torch.full((), self._init_bad_steps, dtype=torch.int32, device=dev)

    @override
    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # One scalar per rank on the scale's device (where the backend reduces); a rank
            # without gradients still takes part, and gets the flag to skip with the others.
            flag = torch.stack([found_inf, *(f.to(found_inf.device) for f in per_device.values())]).amax()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            per_device.setdefault(found_inf.device, found_inf)
            for device_flag in per_device.values():
                device_flag.copy_(flag)
        return per_device

    @override
    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        """Apply Fleet's rule to the overflow flags of this step's `step()` calls.

        Tensor ops on the scale's device only, so no host-device sync. An explicit `new_scale`
        (or a disabled scaler) is handled by the base class.
        """
        if not self._enabled or new_scale is not None:
            super().update(new_scale)
            return
        scale, good_steps = self._check_scale_growth_tracker("update")
        if self._use_dynamic_loss_scaling:
            found_infs = [found_inf.to(scale.device, non_blocking=True)
                          for state in self._per_optimizer_states.values()
                          for found_inf in state["found_inf_per_device"].values()]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._fleet_update(scale, good_steps, self._bad_steps, torch.stack(found_infs).sum() > 0)
        # The overflow flags belong to this step; the next step records its own.
        self._per_optimizer_states.clear()

    def _fleet_update(self, scale: torch.Tensor, good_steps: torch.Tensor, bad_steps: torch.Tensor,
                      found_inf: torch.Tensor) -> None:
        bad = torch.where(found_inf, bad_steps + 1, 0)
        good = torch.where(found_inf, 0, good_steps + 1)
        shrink = bad == self._decr_every_n_nan_or_inf
        grow = good == self._growth_interval
        shrunk = (scale * self._backoff_factor).clamp(min=1.0)
        grown = scale * self._growth_factor
        scale.copy_(torch.where(shrink, shrunk, torch.where(grow & grown.isfinite(), grown, scale)))
        bad_steps.copy_(torch.where(shrink, 0, bad))
        good_steps.copy_(torch.where(grow, 0, good))

    def _get_bad_steps(self) -> int:
        return self._init_bad_steps if self._bad_steps is None else int(self._bad_steps.item())

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._enabled:
            state.update(bad_steps=self._get_bad_steps(),
                         decr_every_n_nan_or_inf=self._decr_every_n_nan_or_inf,
                         use_dynamic_loss_scaling=self._use_dynamic_loss_scaling)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._decr_every_n_nan_or_inf = state_dict["decr_every_n_nan_or_inf"]
        self._use_dynamic_loss_scaling = state_dict["use_dynamic_loss_scaling"]
        self._init_bad_steps = state_dict["bad_steps"]
        if self._bad_steps is not None:
            self._bad_steps.fill_(state_dict["bad_steps"])

    @override
    def __getstate__(self) -> dict[str, Any]:
        # The base class pickles the scale and growth tracker as plain numbers and re-creates
        # the tensors lazily; bad_steps must travel the same way or lazy init would reset it.
        state = super().__getstate__()
        if self._enabled:
            state["_init_bad_steps"] = self._get_bad_steps()
            state["_bad_steps"] = None
        return state


class BFloat16Precision(MixedPrecision):
    """Lightning's bf16-mixed, which clips gradients beside a fused optimizer step too. Lightning
    refuses clipping for any optimizer that unscales gradients in its step (torch's fused ones),
    since with a float16 loss scale clipping would see them scaled; bfloat16 has no loss scale,
    so the gradients clipping sees are the true ones."""

    def __init__(self, device_type: str) -> None:
        super().__init__("bf16-mixed", device_type)

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float | int = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def build_precision(device_type: str, dtype: str, **loss_scaling: Any) -> MixedPrecision:
    """Lightning precision plugin for `dtype` ("float16" or "bfloat16") on `device_type`;
    `loss_scaling` are FleetGradScaler's knobs (ignored for bfloat16, which needs no scaling).

    A plugin instance (unlike `Trainer(precision="16-mixed")`, which Lightning turns into
    bfloat16 on CPU) runs float16 autocast on CPU as well.
    """
    if dtype == "bfloat16":
        return BFloat16Precision(device_type)
    return MixedPrecision("16-mixed", device_type, scaler=FleetGradScaler(device_type, **loss_scaling))


def apply_precision_lists(
    module: nn.Module,
    context: ModelContext,
    dtype: str,
    custom_white_list: list[str],
    custom_black_list: list[str],
) -> list[str]:
    """Force the forward of listed submodules of `module` to `dtype` (white) or float32 (black).

    An entry names modules of the whole model by class name, qualified name or a glob on
    qualified names. Inside a listed module autocast is off, floating inputs and parameters are
    cast to the module's dtype (the casts are differentiable, so gradients reach the float32
    parameters) and buffers are left as they are (a cast copy would lose in-place updates such
    as batch-norm running statistics), and so are the parameters of a module holding floating
    buffers. Only `forward` is replaced, so `state_dict()` keys do not change. Returns the sorted
    qualified names of the modules changed.
    """
    white = match_modules(context.model, custom_white_list, "strategy.amp.custom_white_list")
    black = match_modules(context.model, custom_black_list, "strategy.amp.custom_black_list")
    both = sorted(white.keys() & black.keys())
    if both:
        raise ConfigError("strategy.amp.custom_white_list", both,
                          "these modules are also matched by custom_black_list; a module runs in one precision")
    present = dict(module.named_modules())
    for names, forced in ((white, getattr(torch, dtype)), (black, torch.float32)):
        for name in names.keys() & present.keys():
            _force_dtype(present[name], context.device_type, forced)
    return sorted((white.keys() | black.keys()) & present.keys())


class _CallWith(nn.Module):
    """A throwaway parent whose forward is `forward(module, ...)`.

    `torch.func.functional_call` swaps parameters for the duration of a call to the module it
    is given. Given the listed module itself it would call that module again: its forward
    hooks would run twice and its forward would re-enter the override. Given this parent, the
    parameters are swapped under "module." and only the original forward runs inside.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.inner_forward = forward

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner_forward(self.module, *args, **kwargs)


def _force_dtype(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    # The forward in place so far (the class's, or an override installed before this one),
    # unbound so that a deep copy of the module, which rebinds the method below, calls it on itself.
    previous = module.forward.__func__

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    # Batch norm takes half inputs beside float32 weights and running statistics (as Paddle's
    # batch_norm does), but refuses half weights beside float32 statistics.
    beside_buffers = {child_name(name, parameter_name) for name, sub in float_buffer_modules(module).items()
                      for parameter_name, _ in sub.named_parameters(recurse=False)}

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        parameters = {f"module.{name}": parameter if name in beside_buffers else cast(parameter)
                      for name, parameter in self.named_parameters()}
        args, kwargs = apply_to_collection((args, kwargs), torch.Tensor, cast)
        with torch.autocast(device_type, enabled=False):
            return torch.func.functional_call(_CallWith(self, previous), parameters, args, kwargs)

    module.forward = types.MethodType(forward, module)
