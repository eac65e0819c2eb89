"""Data parallelism across processes: Lightning's DDPStrategy, plus the plan's gradient
communication hook on every device type.

The process-group backend is left to Lightning, which picks it from the environment (nccl on
CUDA, gloo on CPU). Lightning registers DDP communication hooks only on CUDA and skips them
silently elsewhere; lightfleet's hooks (fp16_allreduce, localsgd, dgc, ...) must run on CPU/gloo
too, so this strategy registers them itself. While the run counts its traffic (plugins/traffic.py),
a run without a hook of the plan gets torch's `allreduce_hook`, counted: what DDP does without one.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from typing_extensions import override

from plugins import traffic
from plugins.rehearsal import data_parallel, rehearsing

# Called once the process group exists (hook states may create subgroups): returns (state, hook).
HookFactory = Callable[[], Tuple[Any, Callable]]


class FleetDDPStrategy(DDPStrategy):
    """DDPStrategy whose communication hook is registered on CPU as well as CUDA.

    `comm_hook` builds the hook when DDP wraps the model; the state it returns is kept as
    `comm_hook_state` so callbacks can checkpoint it.
    """

    def __init__(self, comm_hook: Optional[HookFactory] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._make_comm_hook = comm_hook
        self.comm_hook_state: Any = None

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        if rehearsing():  # DDP's C++ reducer cannot run on fake tensors: its buckets and hook in Python
            return data_parallel(model, **self._ddp_kwargs)
        return super()._setup_model(model)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if rehearsing() else super().broadcast(obj, src)  # plugins/rehearsal.py: no objects in a fake world

    @override
    def _register_ddp_hooks(self) -> None:
        if self._make_comm_hook is None:
            if traffic.counting():
                self.model.register_comm_hook(None, traffic.counted_allreduce_hook)
            return
        self.comm_hook_state, hook = self._make_comm_hook()
        self.model.register_comm_hook(self.comm_hook_state, hook)


def process_group_timeout(timeout_s: Optional[float]) -> Dict[str, timedelta]:
    """Lightning's `timeout` argument of a strategy from the plan's timeout_s (collective.timeout_s);
    none: Lightning's default."""
    return {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}


def build_ddp(comm_hook: Optional[HookFactory] = None, timeout_s: Optional[float] = None,
              **ddp_kwargs: Any) -> FleetDDPStrategy:
    """`ddp_kwargs` go to DistributedDataParallel (collective.*: bucket_cap_mb, find_unused_parameters)."""
    return FleetDDPStrategy(comm_hook=comm_hook, **process_group_timeout(timeout_s), **ddp_kwargs)
