"""Pipeline parallelism's split: where the stages begin, which rank holds each, tracing the
model into stages with torch's `pipeline()` frontend, and keeping only this rank's parameters.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from plugins.modules import child_name, repeated_block_list
from runner.core.errors import ConfigError

KEY = "strategy.pipeline"


def stage_ranks(pipeline_size: int, vpp_degree: int, schedule_mode: str) -> list[int]:
    """The pipeline rank holding each stage: looping over the ranks (rank r holds r, r + P, ...),
    or in a V for ZBV (rank r holds r and 2P - 1 - r, so the last stage is back on rank 0)."""
    if schedule_mode == "ZBVZeroBubble":
        return [*range(pipeline_size), *reversed(range(pipeline_size))]
    return [stage % pipeline_size for stage in range(pipeline_size * vpp_degree)]


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
    found = repeated_block_list(model)
    if found is None:
        raise ConfigError(f"{KEY}.split_points", [], "the model has no repeated block list (a ModuleList or "
                                                     "Sequential of >= 2 modules of one class) to split into "
                                                     "stages; name the modules where stages begin")
    prefix, block_list = found
    blocks = list(block_list.children())
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
    return [child_name(prefix, str(index)) for index in balanced_cuts(weights, num_stages)]


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



def trace(model: nn.Module, example: torch.Tensor, split_points: list[str]) -> Any:
    """torch's `pipeline()` on `model`, each stage beginning at one of `split_points`."""
    # pipeline() marks the split modules by replacing their forward; each is put back after.
    forwards = {name: model.get_submodule(name).__dict__.get("forward") for name in split_points}
    try:
        return pipeline(model, mb_args=(example,), split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING))
    except RuntimeError as error:
        cause = str(error.__cause__ or error).strip().splitlines()[0]
        raise ConfigError("model", type(model).__name__, f"cannot be traced into pipeline stages: {cause}") from None
    finally:
        for name, forward in forwards.items():
            module = model.get_submodule(name)
            module.__dict__.pop("_orig_forward", None)
            module.__dict__.pop("forward", None)
            if forward is not None:
                module.forward = forward


@contextlib.contextmanager
def in_eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode, each module's own mode restored after."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)



def keep_only_stages(model: nn.Module, stage_modules: list[nn.Module]) -> None:
    """Drop from `model` the parameters and buffers this rank's stages do not hold (other ranks
    hold them), after refusing parameters the tracer copied because several stages use them."""
    own = {id(p) for p in model.parameters()}
    copied = sorted({name for stage in stage_modules for name, p in stage.named_parameters() if id(p) not in own})
    if copied:
        raise ConfigError(f"{KEY}.split_points", None, f"parameters {', '.join(copied)} are used by more than one "
                                                       "stage (tied weights), which pipeline stages cannot share")
    kept = {id(t) for stage in stage_modules for t in itertools.chain(stage.parameters(), stage.buffers())}
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for name in [name for name, t in registry.items() if t is not None and id(t) not in kept]:
                del registry[name]


def traced_stages(model: nn.Module, example: torch.Tensor, split_points: list[str], stage_ranks: list[int],
                  rank: int, device: torch.device, group: Any) -> list[Any]:
    """The stages of `model` (traced in its current mode on `example`) that pipeline rank `rank` holds."""
    pipe = trace(model, example, split_points)
    if pipe.num_stages != len(stage_ranks):
        raise ConfigError(f"{KEY}.split_points", split_points,
                          f"split the forward into {pipe.num_stages} stages, not {len(stage_ranks)} "
                          "(each must be a module the forward calls, once)")
    return [pipe.build_stage(index, device, group) for index, holder in enumerate(stage_ranks) if holder == rank]
