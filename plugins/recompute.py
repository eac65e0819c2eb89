"""Activation recomputation (Fleet `strategy.recompute`) with torch's checkpoint wrapper.

Each selected submodule is replaced in its parent by a `CheckpointWrapper` (as torchtitan
does): its forward keeps only its inputs for backward and runs again in backward to rebuild
the rest. `state_dict()` keys stay as before. With `enable_offload` the kept inputs wait in
host memory (`save_on_cpu`); batch-norm running statistics are restored after recomputation,
so they are not updated twice. Details: docs/strategies.md#recompute.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from plugins.modules import child_name, match_modules, repeated_block_list
from plugins.transforms import ModelContext
from runner.core.errors import ConfigError

KEY = "strategy.recompute.checkpoints"


def apply_recompute(module: nn.Module, context: ModelContext, checkpoints: list[str], enable_offload: bool) -> list[str]:
    """Wrap, in `module` (the model or one of its pipeline stages), the modules of the whole
    model named by `checkpoints` (all its repeated blocks when empty). Returns the sorted
    qualified names of the modules wrapped in `module`. Raises ConfigError when an entry
    matches no module, or when `checkpoints` is empty and the model has no repeated block list.
    """
    model = context.model
    names = _select(model, checkpoints) if checkpoints else _repeated_blocks(model)
    # Pinned host memory lets the device-to-host copies run asynchronously; it needs CUDA and
    # is a wasted copy when the activations already live on the host.
    pin_memory = context.device_type != "cpu" and torch.cuda.is_available()
    present = {name for name, _ in module.named_modules()}
    wrapped = [name for name in names if name in present]  # a stage holds some of the model's blocks
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        checkpointed = checkpoint_wrapper(module.get_submodule(name), CheckpointImpl.NO_REENTRANT,
                                          checkpoint_fn=_checkpoint, offload=enable_offload, pin_memory=pin_memory)
        module.get_submodule(parent_name).register_module(child, checkpointed)
    return wrapped


def _checkpoint(module: nn.Module, *args, offload: bool, pin_memory: bool, **kwargs):
    # The checkpoint saves its inputs under the saved-tensor hooks active when it is entered
    # (save_on_cpu here), and everything computed inside under its own hooks (recomputed).
    with save_on_cpu(pin_memory=pin_memory) if offload else contextlib.nullcontext():
        if torch.compiler.is_compiling():
            # torch.compile takes no context_fn but its own, and needs none: its recomputation
            # replays the block's computation without its buffer updates, which run once.
            return checkpoint(module, *args, use_reentrant=False, **kwargs)
        return checkpoint(module, *args, use_reentrant=False,
                          context_fn=functools.partial(_keep_running_stats, module), **kwargs)


def _keep_running_stats(module: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's context_fn: nothing around the forward, `_restore_running_stats` around the recomputation."""
    return contextlib.nullcontext(), _restore_running_stats(module)


@contextlib.contextmanager
def _restore_running_stats(module: nn.Module) -> Iterator[None]:
    # The recomputed forward runs in training mode, so batch norm normalises with the batch's
    # statistics (outputs match the forward) but would also fold them into its running
    # statistics a second time. Save them before and put them back after (also when
    # checkpoint stops the recomputation early by raising).
    buffers = [buffer for sub in module.modules() if getattr(sub, "track_running_stats", False)
               for buffer in sub.buffers(recurse=False)]
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def _select(model: nn.Module, checkpoints: list[str]) -> list[str]:
    """Names of the modules matched by `checkpoints`, leaving out those inside another match."""
    selected = match_modules(model, checkpoints, KEY)
    return sorted(name for name in selected if not any(name.startswith(other + ".") for other in selected))


def _repeated_blocks(model: nn.Module) -> list[str]:
    """Children of the model's repeated block list."""
    found = repeated_block_list(model)
    if found is not None:
        name, blocks = found
        return sorted(child_name(name, child) for child, _ in blocks.named_children())
    top_level = ", ".join(name for name, _ in model.named_children())
    raise ConfigError(KEY, [], "the model has no repeated block list (a ModuleList or Sequential of >= 2 "
                               f"modules of one class) to find blocks in; name the modules to recompute "
                               f"(its top-level modules are {top_level})")
