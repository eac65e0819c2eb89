"""Fleet's collective-training knobs (`collective.*`, runner/config/collective.py) carried out by
PyTorch's own mechanisms. `CollectiveConfig.contribute` puts them in the plan (`<- collective`)
and runner/rank/build.py carries them out with the rest of it:

- lightfleet's DDP (plugins.ddp.build_ddp): bucket_cap_mb and find_unused_parameters; every
  Lightning strategy: the process group's timeout;
- Trainer arguments: sync_batchnorm (SyncBatchNorm) and benchmark (cudnn.benchmark);
- op fusion: the fast path's compile (plugins/fast_path.py), the plan's last model transform;
  optimizer fusion: `use_foreach`, an optimizer transform;
- `CollectiveSetup`, a callback, once each rank has its device: torch's threads, the CUDA memory
  fraction, and one info line for a knob this device cannot apply.
Knobs torch has no counterpart for are accepted and do nothing (docs/collective.md says why);
`describe` says what carries out each knob set away from its default (build.yaml).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
import torch
from torch.optim import Optimizer

from plugins.fast_path import say, set_foreach
from runner.config.collective import OP_FUSION_FLAGS, UNFUSED_BUCKET_MB, CollectiveConfig, collective_knobs

# What a knob set away from its default does, by its key under collective.
MECHANISM = {
    "fuse_all_reduce_ops": f"DDP gradient buckets (false: bucket_cap_mb={UNFUSED_BUCKET_MB})",
    "fuse_grad_size_in_MB": "DDP bucket_cap_mb",
    "sync_batch_norm": "Trainer sync_batchnorm=True (SyncBatchNorm)",
    "find_unused_parameters": "DDP find_unused_parameters",
    "cudnn_exhaustive_search": "Trainer benchmark=True (torch.backends.cudnn.benchmark)",
    "gpu_memory_fraction": "torch.cuda.set_per_process_memory_fraction",
    "timeout_s": "the process group's timeout",
    "build_strategy.fuse_all_optimizer_ops": "the optimizer's foreach implementation",
    "execution_strategy.num_threads": "torch.set_num_threads on every rank",
    **{f"build_strategy.{flag}": "torch.compile of the model" for flag in OP_FUSION_FLAGS},
}


def use_foreach(optimizer: Optimizer) -> Optimizer:
    """The optimizer on its foreach (multi-tensor) implementation, where it has one."""
    if not set_foreach(optimizer):
        say(f"collective.build_strategy.fuse_all_optimizer_ops: {type(optimizer).__name__} has no foreach "
            "implementation; no effect")
    return optimizer


def changed_settings(config: CollectiveConfig) -> Dict[str, Any]:
    """The knobs away from their defaults, by key under collective (build_strategy.x, ...)."""
    defaults = collective_knobs(CollectiveConfig())
    return {key: value for key, value in collective_knobs(config).items() if value != defaults[key]}


def describe(config: CollectiveConfig, uses_ddp: bool, sharded: bool) -> List[str]:
    """A line per knob away from its default: what carries it out in this run, or why nothing does."""
    lines = []
    for key, value in changed_settings(config).items():
        mechanism = MECHANISM.get(key, "no effect in PyTorch (docs/collective.md)")
        if key in ("fuse_all_reduce_ops", "fuse_grad_size_in_MB", "find_unused_parameters") and not uses_ddp:
            mechanism += ": no effect, this run has no lightfleet DDP"
        if key in ("use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks"):
            mechanism = ("hybrid sharding's 2-D mesh: sharding groups of strategy.sharding.degree ranks, "
                         "replicated dp_degree times (both set from it)" if sharded
                         else "no effect: DDP has no two-level allreduce")
        lines.append(f"collective.{key}={value!r} -> {mechanism}")
    return lines


class CollectiveSetup(pl.Callback):
    """Once the rank has its device: torch's thread count, the CUDA memory fraction, and one info
    line for each knob given here that needs CUDA on another device (sync_batch_norm is given
    only where the plan could not carry it out)."""

    def __init__(self, num_threads: int, gpu_memory_fraction: Optional[float], cudnn_exhaustive_search: bool,
                 sync_batch_norm: bool) -> None:
        self.num_threads = num_threads
        self.gpu_memory_fraction = gpu_memory_fraction
        asked = (("cudnn_exhaustive_search", cudnn_exhaustive_search, "cuDNN runs on CUDA only"),
                 ("sync_batch_norm", sync_batch_norm, "DDP runs SyncBatchNorm on GPUs only"))
        self.needs_cuda = {knob: why for knob, on, why in asked if on}  # knob -> why it needs CUDA

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Here, not at build: Lightning sets the threads of DDP's CPU processes when it sets up the strategy.
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        device = trainer.strategy.root_device
        if self.gpu_memory_fraction is not None:
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(self.gpu_memory_fraction, device)
            else:
                say(f"collective.gpu_memory_fraction: applies to CUDA memory only; no effect on {device.type}")
        for knob, why in self.needs_cuda.items():
            if device.type != "cuda":
                say(f"collective.{knob}: {why}; no effect on {device.type}")
