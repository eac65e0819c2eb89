"""Pipeline parallelism's checkpoint layout: one distributed-checkpoint directory (written by
Lightning's ModelParallelStrategy) in which every rank keeps its stages' parameters and
optimizer state under the unsplit model's names: the ranks of one pipeline write disjoint keys,
its replicas the same parameters (written once) and, with ZeRO, disjoint shares of the states.
A rank reads back by name what its stages hold, so a checkpoint loads on any layout: other
replica counts (ZeRO's shares split or joined again), other stage cuts (docs/reliability.md,
"Pipeline and tensor-parallel layouts").
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.strategies.fsdp import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

# Optimizer state keyed by parameter name, hyper-parameters too: every rank's keys differ, so the
# distributed checkpoint keeps each rank's (a list of parameter groups would collide across ranks).
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """This rank's optimizer state, by parameter name."""
    return get_optimizer_state_dict(model, local_optimizer(optimizer), options=BY_NAME)


def load_stages(model: nn.Module, optimizers: List[torch.optim.Optimizer], path: Path,
                weights_only: Optional[bool]) -> Dict[str, Any]:
    """Read this rank's parameters and optimizer states from the checkpoint directory `path`;
    returns the rest of what Lightning saved."""
    keys = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)}
    state = {"state_dict": get_model_state_dict(model),
             **{key: optimizer_state(model, optimizer) for key, optimizer in keys.items()}}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"])
    for key, optimizer in keys.items():
        set_optimizer_state_dict(model, local_optimizer(optimizer), optim_state_dict=state[key], options=BY_NAME)
        if isinstance(optimizer, ZeroRedundancyOptimizer):  # the restored hyper-parameters, back up
            optimizer._sync_param_groups(optimizer.optim.param_groups, optimizer.param_groups)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer over this rank's share of the parameters: with ZeRO, its state by parameter
    name is disjoint from the other replicas', so every rank saves its own into the checkpoint.
    ZeRO copies its hyper-parameters (changed by LR schedulers) into the share only when it
    steps; here they are copied at once."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    optimizer._sync_param_groups(optimizer.param_groups, optimizer.optim.param_groups)
    return optimizer.optim
