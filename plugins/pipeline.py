"""Pipeline parallelism (Fleet `strategy.pipeline`) on `torch.distributed.pipelining` schedules.

Lightning has no pipeline strategy, so `PipelineStrategy` carries one out. Each process is one
pipeline rank (no data parallelism: every rank reads the same batches) holding `vpp_degree`
stages. At setup the model is traced by torch's frontend (`pipeline()`, torch.export) on a
micro-batch of the first training batch and split where the stages begin; the traced stage
modules share the model's parameter objects under their original names. The model then keeps
only this rank's parameters and buffers, so the optimizer, `state_dict()` and the distributed
checkpoint (one directory, every rank writing its own keys, by ModelParallelStrategy) hold this
rank's stages under the names of the unsplit model.

A training step runs the schedule on the batch: inputs go to the first stage, targets to the
last, whose loss is the model's `loss(outputs, targets)` per micro-batch; the schedule runs
backward itself, so the gradient is that of the mean micro-batch loss. The user's
`training_step` is bypassed: the mean loss is broadcast from the last stage and logged as
`train_loss` on every rank. Only fitting is supported (the traced graph is the training-mode
forward), without validation.

Recomputation (plugins/recompute.py wraps blocks before the strategy sees the model) cannot be
traced through; the wrappers are taken off for tracing and the same wrappers are put around
the traced blocks, which then recompute in backward as before.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.strategies.strategy import _optimizers_to_device
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble, SplitPoint, pipeline)
from typing_extensions import override

from runner.errors import ConfigError

KEY = "strategy.pipeline"
SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble}
# Schedules placing one stage per rank; the others take the list of a rank's stages.
SINGLE_STAGE = ("1F1B", "GPipe")


def build_pipeline(schedule_mode: str, micro_batch_size: int, accumulate_steps: int, split_points: list[str],
                   vpp_degree: int) -> "PipelineStrategy":
    return PipelineStrategy(schedule_mode, micro_batch_size, accumulate_steps, split_points, vpp_degree)


def stage_ranks(world_size: int, vpp_degree: int, schedule_mode: str) -> list[int]:
    """The rank holding each stage: looping over the ranks (rank r holds r, r + W, ...), or in a
    V for ZBV (rank r holds r and 2W - 1 - r, so the last stage is back on rank 0)."""
    if schedule_mode == "ZBVZeroBubble":
        return [*range(world_size), *reversed(range(world_size))]
    return [stage % world_size for stage in range(world_size * vpp_degree)]


def stage_split_points(model: nn.Module, split_points: list[str], num_stages: int) -> list[str]:
    """Names of the modules where stages 1 .. num_stages - 1 begin: `split_points` checked, or
    the model's repeated block list cut into `num_stages` runs of blocks of balanced parameter
    counts (the parameters before the blocks count with the first run, those after with the last)."""
    if split_points:
        names = {name for name, _ in model.named_modules() if name}
        unknown = [name for name in split_points if name not in names]
        if unknown:
            raise ConfigError(f"{KEY}.split_points", unknown, "name no module of the model")
        if len(split_points) != num_stages - 1:
            raise ConfigError(f"{KEY}.split_points", split_points,
                              f"name {len(split_points)} stage beginnings; {num_stages} stages need {num_stages - 1}")
        return list(split_points)
    prefix, blocks = repeated_blocks(model)
    if len(blocks) < num_stages:
        raise ConfigError(f"{KEY}.split_points", [], f"the model's repeated block list {prefix} has {len(blocks)} "
                                                     f"blocks, fewer than the {num_stages} stages; name the modules "
                                                     "where stages begin")
    params = list(model.parameters())
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    first = next((i for i, p in enumerate(params) if id(p) in in_blocks), len(params))
    outside = [(i, p.numel()) for i, p in enumerate(params) if id(p) not in in_blocks]
    weights = [sum(p.numel() for p in block.parameters()) for block in blocks]
    weights[0] += sum(numel for i, numel in outside if i < first)
    weights[-1] += sum(numel for i, numel in outside if i > first)
    return [f"{prefix}.{index}" for index in balanced_cuts(weights, num_stages)]


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """(name, children) of the first ModuleList/Sequential holding >= 2 modules of one class
    (plugins/recompute.py's rule)."""
    for name, module in model.named_modules():
        children = list(module.children())
        if (name and isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
                and len({type(child) for child in children}) == 1):
            return name, children
    raise ConfigError(f"{KEY}.split_points", [], "the model has no repeated block list (a ModuleList or Sequential "
                                                 "of >= 2 modules of one class) to split into stages; name the "
                                                 "modules where stages begin")


def balanced_cuts(weights: list[int], parts: int) -> list[int]:
    """Start indices of parts 1 .. parts - 1 of the split of `weights` into `parts` non-empty
    contiguous runs whose heaviest run is lightest."""
    prefix = [0, *itertools.accumulate(weights)]

    @functools.cache
    def best(start: int, runs: int) -> tuple[int, tuple[int, ...]]:
        if runs == 1:
            return prefix[-1] - prefix[start], ()
        return min((max(prefix[cut] - prefix[start], best(cut, runs - 1)[0]), (cut, *best(cut, runs - 1)[1]))
                   for cut in range(start + 1, len(weights) - runs + 2))

    return list(best(0, parts)[1])
