"""Finding a model's submodules by the names users write in strategy knobs."""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase

from torch import nn

from runner.errors import ConfigError


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
