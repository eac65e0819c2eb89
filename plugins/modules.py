"""Finding a model's submodules by the names users write in strategy knobs."""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Optional

from torch import nn

from runner.core.errors import ConfigError


def match_modules(model: nn.Module, entries: list[str], key: str) -> dict[str, nn.Module]:
    """Submodules, by qualified name, that any entry names: by class name, qualified name, or a
    glob on qualified names. The root is never matched: it is the whole model, with no parent
    to be replaced in. An entry matching nothing raises ConfigError naming `key`, with the
    nearest module names and a "did you mean"."""
    modules = {name: module for name, module in model.named_modules() if name}
    matched: dict[str, nn.Module] = {}
    for entry in entries:
        hits = {name: module for name, module in modules.items()
                if entry == type(module).__name__ or entry == name or fnmatchcase(name, entry)}
        if not hits:
            near = difflib.get_close_matches(entry, list(modules), n=4, cutoff=0.0)
            choices = sorted(set(modules) | {type(module).__name__ for module in modules.values()})
            raise ConfigError(key, entry, f"matches no module of the model; module names include {', '.join(near)}",
                              choices)
        matched.update(hits)
    return matched


def repeated_block_list(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(name, module) of the model's first ModuleList/Sequential holding >= 2 children of one
    class (the name is "" when that is the model itself): the model's repeated blocks, which
    recompute wraps and pipeline cuts between."""
    for name, module in model.named_modules():
        children = list(module.children())
        if (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
                and len({type(child) for child in children}) == 1):
            return name, module
    return None


def float_buffer_modules(root: nn.Module) -> dict[str, nn.Module]:
    """Modules of `root` ("" names `root` itself) holding both parameters and floating-point
    buffers of their own, such as batch norm (weights and running statistics): amp leaves their
    parameters in the buffers' precision, where the module's kernels expect them."""
    return {name: module for name, module in root.named_modules()
            if any(True for _ in module.parameters(recurse=False))
            and any(buffer.is_floating_point() for buffer in module.buffers(recurse=False))}


def child_name(parent: str, child: str) -> str:
    """Qualified name of `child` under the module named `parent` ("" for the root)."""
    return f"{parent}.{child}" if parent else child
