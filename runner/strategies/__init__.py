"""The strategy registry: every module of this package is one strategy, named as the module.

It is the only list of strategies: the config schema's `strategy` node, the table's check of
its names, `--help`, docs/knobs.md and the combination tests all read it. Listing the names
imports nothing (the fast refusal path); `schemas()` imports the modules, which are pure Python.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from typing import Dict, Tuple

from runner.core.contribution import Strategy


@functools.lru_cache(maxsize=None)
def names() -> Tuple[str, ...]:
    """The strategies, in alphabetical order."""
    return tuple(sorted(module.name for module in pkgutil.iter_modules(__path__) if not module.name.startswith("_")))


@functools.lru_cache(maxsize=None)
def schemas() -> Dict[str, type]:
    """Strategy name -> its knobs dataclass: the Strategy subclass its module defines with a `name`
    (a module may define a base for several strategies beside it: localsgd's LocalSGDFamily)."""
    found = {}
    for name in names():
        module = importlib.import_module(f"{__name__}.{name}")
        classes = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                   if issubclass(cls, Strategy) and cls.__module__ == module.__name__ and "name" in vars(cls)]
        if len(classes) != 1 or classes[0].name != name:
            raise TypeError(f"runner/strategies/{name}.py must define one Strategy subclass with name = {name!r}, "
                            f"found {[cls.__name__ for cls in classes]}")
        found[name] = classes[0]
    return found
