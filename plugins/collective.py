"""Fleet's collective-training knobs (`collective.*`, runner.config.schema.CollectiveConfig) carried out by
PyTorch's own mechanisms; runner/rank/build.py applies them:

- DDP: bucket_cap_mb and find_unused_parameters, passed to plugins.ddp.build_ddp;
- Trainer arguments: sync_batchnorm (SyncBatchNorm) and benchmark (cudnn.benchmark);
- op fusion: torch.compile of the model, after the plan's model transforms; optimizer fusion:
  the optimizer's foreach implementation;
- `CollectiveSetup`, a callback, once each rank has its device: torch's threads, the CUDA memory
  fraction, and one info line for a knob this device cannot apply.
Knobs torch has no counterpart for are accepted and do nothing (docs/collective.md says why).
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Dict, List

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_only
from torch import nn
from torch.optim import Optimizer

from plugins.transforms import ModelContext
from runner.core.errors import require
from runner.config.schema import CollectiveConfig, TrainerConfig, collective_knobs

# fuse_all_reduce_ops=false: DDP always buckets gradients (a bucket per tensor cannot be asked for);
# 1 KB buckets come closest, each holding one tensor or a few small ones.
UNFUSED_BUCKET_MB = 0.001
OP_FUSION_FLAGS = ("fuse_elewise_add_act_ops", "fuse_bn_act_ops", "fuse_relu_depthwise_conv",
                   "enable_auto_fusion", "fuse_gemm_epilogue", "fuse_dropout_add")
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


def set_timeout(strategy: Any, config: CollectiveConfig) -> None:
    """The process group's timeout on the run's Lightning strategy (DDP's, sharding's or the
    pipeline's: each takes Lightning's `timeout`, read when the process group is made)."""
    if config.timeout_s is not None and hasattr(strategy, "_timeout"):
        strategy._timeout = timedelta(seconds=config.timeout_s)


@rank_zero_only
def say(line: str) -> None:
    print(f"lightfleet: {line}", file=sys.stderr, flush=True)


def ddp_kwargs(config: CollectiveConfig) -> Dict[str, Any]:
    """The DDP arguments of the fusion and unused-parameter knobs."""
    bucket_mb = config.fuse_grad_size_in_MB if config.fuse_all_reduce_ops else UNFUSED_BUCKET_MB
    return {"bucket_cap_mb": bucket_mb, "find_unused_parameters": config.find_unused_parameters}


def trainer_args(config: CollectiveConfig, trainer: TrainerConfig, device_type: str) -> Dict[str, Any]:
    """The Trainer arguments of sync_batch_norm and cudnn_exhaustive_search. trainer.sync_batchnorm
    is false unless set (trainer=ddp sets it), so either one asking turns SyncBatchNorm on; DDP
    refuses SyncBatchNorm on CPU, where the knob gives an info line instead."""
    args: Dict[str, Any] = {}
    if config.sync_batch_norm and device_type == "cuda":
        args["sync_batchnorm"] = True
    elif config.sync_batch_norm:
        say(f"collective.sync_batch_norm: DDP runs SyncBatchNorm on GPUs only; no effect on {device_type}")
    if config.cudnn_exhaustive_search:
        require(trainer.benchmark is not False, "collective.cudnn_exhaustive_search", True,
                "trainer.benchmark=false says the opposite; set only one of them")
        args["benchmark"] = True
    return args


def compiles(config: CollectiveConfig) -> bool:
    """Whether an op-fusion flag is on: torch.compile is PyTorch's op fusion."""
    return any(getattr(config.build_strategy, flag) for flag in OP_FUSION_FLAGS)


def compile_model(part: nn.Module, context: ModelContext) -> List[str]:
    """A model transform: compile `part` in place (nn.Module.compile), so the LightningModule's
    calls of itself run the compiled graph and DDP still wraps the same module object."""
    part.compile(mode="default")
    return [type(part).__name__]


def use_foreach(optimizer: Optimizer) -> Optimizer:
    """Switch the optimizer to its foreach (multi-tensor) implementation: torch's optimizers read
    `foreach` from the param groups at every step, so it can be set after construction."""
    if "foreach" not in optimizer.defaults:
        say(f"collective.build_strategy.fuse_all_optimizer_ops: {type(optimizer).__name__} has no foreach "
            "implementation; no effect")
        return optimizer
    optimizer.defaults["foreach"] = True
    for group in optimizer.param_groups:
        group["foreach"] = True
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
    line for each knob that needs CUDA on another device."""

    def __init__(self, config: CollectiveConfig) -> None:
        self.config = config

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Here, not at build: Lightning sets the threads of DDP's CPU processes when it sets up the strategy.
        if self.config.execution_strategy.num_threads:
            torch.set_num_threads(self.config.execution_strategy.num_threads)
        device = trainer.strategy.root_device
        if self.config.gpu_memory_fraction is not None:
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(self.config.gpu_memory_fraction, device)
            else:
                say(f"collective.gpu_memory_fraction: applies to CUDA memory only; no effect on {device.type}")
        if self.config.cudnn_exhaustive_search and device.type != "cuda":
            say(f"collective.cudnn_exhaustive_search: cuDNN runs on CUDA only; no effect on {device.type}")
