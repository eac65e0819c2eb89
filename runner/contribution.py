"""What a strategy says it adds to a run, as plain data; runner/plan.py combines these.

A strategy (runner/strategies/<name>.py) is a dataclass of its knobs deriving from `Strategy`:
its fields are the knobs (each documented by the string under it), `__post_init__` checks
their ranges, and `contribute(run)` returns a `Contribution`. No torch here or there.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from runner.errors import Refusal
from runner.world import Layout, World


@dataclass(frozen=True)
class Component:
    """A callable named by import path ("package.module:attr") and the keyword arguments it gets.

    Calling conventions by plan slot: precision `f(device_type=..., **kwargs) -> Precision`;
    lightning_strategy `f(comm_hook=None, **kwargs) -> Strategy` (comm_hook only where it takes
    one); comm hook `f(**kwargs) -> (state, hook)`, called once the process group exists;
    optimizer replacement `f(optimizer, model=..., **kwargs) -> Optimizer`, applied to each
    optimizer the model's `configure_optimizers` returns; model transform `f(module, context,
    **kwargs) -> names of the modules changed` (plugins/transforms.py); callback `f(**kwargs) -> Callback`.
    """

    target: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RunShape:
    """What a strategy may know about the run when it contributes: its processes, the data's
    batch size per step and process (None when the data config has none), and the selected
    strategies' knobs, by name."""

    world: World
    batch_size: Optional[int] = None
    selected: Dict[str, "Strategy"] = field(default_factory=dict)

    @functools.cached_property
    def layout(self) -> Optional[Layout]:
        """The process layout a selected strategy arranges (one that defines `layout(run)`), or None."""
        arranged = {name: knobs.layout(self) for name, knobs in self.selected.items() if hasattr(knobs, "layout")}
        if len(arranged) > 1:
            raise Refusal(f"{' and '.join(arranged)} both arrange the processes; choose one of them")
        return next(iter(arranged.values()), None)


@dataclass
class Contribution:
    """What one strategy adds to the plan: claims on the exclusive slots, model transforms by
    phase, trainer arguments, callbacks and notes for the printed plan."""

    precision: Optional[Component] = None
    lightning_strategy: Optional[Component] = None
    takes_comm_hook: bool = False  # whether `lightning_strategy` registers a gradient communication hook
    optimizer: Optional[Component] = None
    comm_hook: Optional[Component] = None
    model_transforms: List[Tuple[str, Component]] = field(default_factory=list)  # (phase, component)
    trainer_args: Dict[str, Any] = field(default_factory=dict)
    callbacks: List[Component] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


class Strategy:
    """Base of every strategy's knobs dataclass; `name` is its module's name in runner/strategies/."""

    name: ClassVar[str]

    def contribute(self, run: RunShape) -> Contribution:
        raise NotImplementedError(f"{type(self).__name__}.contribute")
